"""Tier choice for new entries on synthetic machine profiles: no model, no timing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvreuse.controller.placement import NewEntry, PlacementPolicy, choose_tier, recompute_seconds_per_layer

from .support import KV_BYTES, LAYERS, synthetic_profile

# 512 tokens read in one layer: memory 0.08 ms, ssd 0.89 ms, hdd 17.9 ms
ENTRY = NewEntry(tokens=512, ratio=0.15, context_rows=32)  # 77 of its rows and 32 fresh ones recomputed
ENTRY_BYTES = 512 * KV_BYTES * LAYERS
ROOMY = [("memory", None), ("ssd", None), ("hdd", None)]
machine = synthetic_profile


FAST = machine(1e-6)  # 109 rows: 0.11 ms per layer, hides no device read
MEDIUM = machine(20e-6)  # 2.2 ms: hides the ssd, not the hdd
SLOW = machine(200e-6)  # 22 ms: hides even the hdd


def test_fast_compute_keeps_the_entry_in_memory():
    placement = choose_tier(FAST, ROOMY, ENTRY)
    assert placement.tier == 0 and "no slower tier" in placement.reason


def test_slow_compute_sends_the_entry_to_the_slowest_tier():
    placement = choose_tier(SLOW, ROOMY, ENTRY)
    assert placement.tier == 2 and placement.reason.startswith("hdd")


def test_medium_compute_picks_the_slowest_tier_whose_read_hides():
    assert choose_tier(MEDIUM, ROOMY, ENTRY).tier == 1


def test_a_full_slow_tier_falls_back_to_the_next_faster_one():
    almost_full = [("memory", None), ("ssd", ENTRY_BYTES), ("hdd", ENTRY_BYTES - 1)]
    assert choose_tier(SLOW, almost_full, ENTRY).tier == 1


def test_no_room_anywhere_slower_keeps_the_entry_in_memory():
    assert choose_tier(SLOW, [("memory", 0), ("ssd", 0), ("hdd", 0)], ENTRY).tier == 0


@pytest.mark.parametrize("hits,tier", [(0, 2), (1, 2), (2, 0), (7, 0)])
def test_a_hot_entry_stays_in_memory(hits, tier):
    placement = choose_tier(SLOW, ROOMY, replace(ENTRY, hits=hits))
    assert placement.tier == tier
    assert ("hot" in placement.reason) == (tier == 0)


def test_the_hot_threshold_is_a_policy_knob():
    entry = replace(ENTRY, hits=3)
    assert choose_tier(SLOW, ROOMY, entry, PlacementPolicy(hot_hits=4)).tier == 2
    assert choose_tier(SLOW, ROOMY, entry, PlacementPolicy(hot_hits=3)).tier == 0


@pytest.mark.parametrize("name", ["memory", "hdd"])
def test_a_single_tier_store_always_gets_tier_0(name):
    assert choose_tier(SLOW, [(name, 0)], ENTRY).tier == 0


def test_more_recompute_alongside_lets_a_slower_tier_hide():
    lone = NewEntry(tokens=512, ratio=0.15)  # 77 rows on MEDIUM: 1.5 ms, the ssd's 0.89 ms hides
    with_question = NewEntry(tokens=512, ratio=0.15, context_rows=1000)  # 1077 rows: 21.5 ms, the hdd hides
    assert choose_tier(MEDIUM, ROOMY, lone).tier == 1
    assert choose_tier(MEDIUM, ROOMY, with_question).tier == 2


def test_recompute_counts_attention_and_placing_of_the_loaded_rows():
    profile = synthetic_profile(0.0, score_seconds=1.0, place_seconds=1000.0)
    entry = NewEntry(tokens=100, ratio=0.1, context_rows=5)
    # 10 own rows and 5 context rows are too few to split: one masked call of 15 queries over all 105 keys
    assert recompute_seconds_per_layer(profile, entry) == 15 * 105 + 90 * 1000.0


def test_an_unknown_tier_name_is_named():
    with pytest.raises(ValueError, match="'nvme'"):
        choose_tier(SLOW, [("memory", None), ("nvme", None)], ENTRY)


@pytest.mark.parametrize("tiers,named", [([], "tiers"), ([("memory", None), ("ssd", -1)], "ssd")])
def test_bad_tiers_are_named(tiers, named):
    with pytest.raises(ValueError, match=named):
        choose_tier(SLOW, tiers, ENTRY)


@pytest.mark.parametrize("fields,named", [(dict(tokens=0), "tokens"), (dict(ratio=1.5), "ratio"),
                                          (dict(context_rows=-1), "context_rows"), (dict(hits=-1), "hits")])
def test_bad_entry_fields_are_named(fields, named):
    with pytest.raises(ValueError, match=named):
        NewEntry(**(dict(tokens=512, ratio=0.15) | fields))


def test_bad_policy_is_named():
    with pytest.raises(ValueError, match="hot_hits"):
        PlacementPolicy(hot_hits=0)
