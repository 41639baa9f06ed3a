"""The contract every tier and the tiered store keep: the same tests, run on each kind."""

from __future__ import annotations

import pytest
import torch

from kvreuse.store.base import view_planned
from kvreuse.store.keys import InvalidKey, KeySpace, chunk_key


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(tier, dtype, make_entry):
    entry = make_entry(dtype=dtype, extras=True)
    assert tier.put(entry)
    got = tier.get(entry.key)
    assert got is not None and got.key == entry.key
    assert_same(got.k, entry.k)
    assert_same(got.v, entry.v)
    m, g = entry.meta, got.meta
    assert (g.model_fingerprint, g.dtype, g.num_layers, g.num_tokens, g.compile_mode, g.boundary_layers) == (
        m.model_fingerprint, m.dtype, m.num_layers, m.num_tokens, m.compile_mode, m.boundary_layers)
    assert_same(g.ranking, m.ranking)
    assert_same(g.boundary, m.boundary)


def test_contains_delete_and_miss(tier, make_entry):
    entry = make_entry()
    assert not tier.contains(entry.key)
    assert tier.get(entry.key) is None
    assert tier.get_layers(entry.key, 0, 1) is None
    assert tier.view_layers(entry.key, 0, 1) is None
    assert tier.get_rows(entry.key, [0]) is None
    assert tier.view_rows(entry.key, [0]) is None
    tier.put(entry)
    assert tier.contains(entry.key)
    assert tier.delete(entry.key)
    assert not tier.contains(entry.key)
    assert tier.get(entry.key) is None
    assert not tier.delete(entry.key)


@pytest.mark.parametrize("start,stop", [(0, 4), (1, 3), (3, 4), (2, 2)])
@pytest.mark.parametrize("read", ["get_layers", "view_layers"])
def test_get_and_view_layers_return_exactly_that_range(tier, read, start, stop, make_entry):
    entry = make_entry()
    tier.put(entry)
    k, v = getattr(tier, read)(entry.key, start, stop)
    assert_same(k, entry.k[start:stop])
    assert_same(v, entry.v[start:stop])


@pytest.mark.parametrize("rows", [[5], [99, 3, 70, 70, 0], list(range(100)), [63, 64], [], list(range(16, 90)),
                                  [4, 5, 6, 8]])
@pytest.mark.parametrize("layers", [None, range(1, 3)])
@pytest.mark.parametrize("read", ["get_rows", "view_rows"])
def test_get_and_view_rows_return_exactly_those_rows(tier, read, rows, layers, make_entry):
    entry = make_entry(dtype=torch.bfloat16)
    tier.put(entry)
    k, v = getattr(tier, read)(entry.key, torch.tensor(rows, dtype=torch.long), layers)
    lay = slice(None) if layers is None else slice(layers.start, layers.stop)
    assert_same(k, entry.k[lay][:, rows])
    assert_same(v, entry.v[lay][:, rows])


@pytest.mark.parametrize("rows", [[5], [99, 3, 70, 70, 0], list(range(16, 90)), [4, 5, 6, 8], []])
def test_view_picking_hands_out_those_rows_or_layers_to_pick_them_from(tier, rows, make_entry):
    """What the KV placer reads: the rows themselves, or the layers with the rows to pick (a tier keeping tensors)."""
    entry = make_entry(dtype=torch.bfloat16)
    tier.put(entry)
    assert tier.view_picking(entry.key.replace(entry.key[-4:], "0000"), [0]) is None
    k, v, picks = tier.view_picking(entry.key, torch.tensor(rows, dtype=torch.long), range(1, 3))
    assert k.shape[0] == 2 and (picks is None or picks.numel() == len(rows))  # picks index the rows handed out
    assert_same(k if picks is None else k[:, picks], entry.k[1:3, rows])
    assert_same(v if picks is None else v[:, picks], entry.v[1:3, rows])
    with pytest.raises(ValueError, match="token rows"):
        tier.view_picking(entry.key, [99, 100])


def test_view_layers_picking_hands_out_those_layers_or_their_rows_to_pick(tier, make_entry):
    entry = make_entry(dtype=torch.bfloat16, extras=True)
    tier.put(entry)
    assert tier.view_layers_picking(entry.key.replace(entry.key[-4:], "0000"), 0, 1) is None
    k, v, picks = tier.view_layers_picking(entry.key, 1, 3)
    assert k.shape[0] == 2 and (picks is None or sorted(picks.tolist()) == list(range(100)))
    assert_same(k if picks is None else k[:, picks], entry.k[1:3])
    assert_same(v if picks is None else v[:, picks], entry.v[1:3])


def test_partial_reads_reject_bad_ranges(tier, make_entry):
    entry = make_entry()
    tier.put(entry)
    with pytest.raises(ValueError, match="layer range"):
        tier.get_layers(entry.key, 2, 9)
    with pytest.raises(ValueError, match="layer range"):
        tier.view_layers(entry.key, 2, 9)
    with pytest.raises(ValueError, match="token rows"):
        tier.get_rows(entry.key, [100])
    with pytest.raises(ValueError, match="token rows"):
        tier.view_rows(entry.key, [99, 100])
    with pytest.raises(ValueError, match="layer range"):
        tier.get_rows(entry.key, [1], range(0, 4, 2))


def test_reads_are_copies(tier, make_entry):
    entry = make_entry()
    tier.put(entry)
    entry.k.zero_()  # the store must have kept its own bytes...
    got = tier.get(entry.key)
    assert got.k.abs().sum() > 0
    got.k.zero_()  # ...and must hand out bytes the caller can overwrite
    k, _ = tier.get_layers(entry.key, 0, 4)
    assert torch.equal(k, tier.get(entry.key).k) and k.abs().sum() > 0
    for rows in (torch.arange(3, 9), torch.tensor([7, 2, 5])):  # a run of rows, and rows in another order
        k, v = tier.get_rows(entry.key, rows)
        k.zero_(), v.zero_()
        stored = tier.get(entry.key)
        assert stored.k[:, rows].abs().sum() > 0 and stored.v[:, rows].abs().sum() > 0


@pytest.mark.parametrize("bad", ["../../etc/passwd", "a/b", "..", "", "x" * 129, "key with space", "ключ"])
def test_invalid_keys_are_refused(tier, bad, make_entry):
    for call in (tier.contains, tier.get, tier.delete, lambda key: tier.get_layers(key, 0, 1)):
        with pytest.raises(InvalidKey, match="invalid store key"):
            call(bad)


def test_salts_never_share_entries(tier, make_entry):
    tokens = [1, 2, 3, 4]
    key_a = chunk_key(tokens, KeySpace("m", "t", salt="tenant-a"))
    key_b = chunk_key(tokens, KeySpace("m", "t", salt="tenant-b"))
    tier.put(make_entry(key_a))
    assert tier.get(key_a) is not None
    assert tier.get(key_b) is None and not tier.contains(key_b)


def test_same_content_is_stored_once(tier, make_entry):
    entry = make_entry()
    assert tier.put(entry) and tier.put(entry)
    assert list(tier.keys()).count(entry.key) == 1


def test_keys_meta_and_clear(tier, make_entry):
    entries = [make_entry(extras=True) for _ in range(3)]
    for e in entries:
        tier.put(e)
    assert sorted(tier.keys()) == sorted(e.key for e in entries)
    meta = tier.meta(entries[0].key)
    assert (meta.num_layers, meta.num_tokens, meta.dtype) == (4, 100, "float32")
    assert meta.ranking is None and meta.boundary is None  # listing reads no per-token tensors
    with_extras = tier.meta(entries[0].key, with_extras=True)
    assert_same(with_extras.ranking, entries[0].meta.ranking)
    assert_same(with_extras.boundary, entries[0].meta.boundary)
    assert tier.meta(make_entry().key) is None
    assert tier.clear() == 3
    assert list(tier.keys()) == []


def test_entry_of_other_model_is_refused(tier_maker, make_entry):
    tier = tier_maker(model_fingerprint="model-a", dtype="float32")
    with pytest.raises(ValueError, match="model-a/float32"):
        tier.put(make_entry(model="model-b"))
    with pytest.raises(ValueError, match="model-a/float32"):
        tier.put(make_entry(model="model-a", dtype=torch.float16))


def test_stats_count_hits_and_misses(tier, make_entry):
    entry = make_entry()
    tier.put(entry)
    tier.get(entry.key)
    tier.get(make_entry().key)
    stats = tier.stats()
    tiers = stats.get("tiers", [stats])
    assert tiers[0]["hits"] == 1
    assert sum(t["misses"] for t in tiers) >= 1


@pytest.mark.parametrize("layers, rows, num_rows, form", [
    (range(0, 5), None, 100, (torch.float32, (2, 16))),  # a layer the entry does not hold
    (range(0, 4), torch.tensor([3, 100]), 2, (torch.float32, (2, 16))),  # a row it does not hold
    (range(0, 4), None, 99, (torch.float32, (2, 16))),  # not the rows the plan counted on
    (range(0, 4), None, 100, (torch.float32, (3, 16))),  # rows of another shape than the cache's
    (range(0, 4), None, 100, (torch.bfloat16, (2, 16))),  # of another dtype
])
def test_a_planned_read_of_an_entry_that_does_not_hold_what_the_plan_counts_on_is_a_miss(tier, make_entry, layers,
                                                                                         rows, num_rows, form):
    """view_planned, the plan's read: where the entry under a key is not the one the plan was made for (a writer's
    bug, a store two models share), None, as for a missing entry; the engine then recomputes it."""
    entry = make_entry()  # 4 layers, 100 tokens, 2 heads of 16, fp32
    tier.put(entry)
    k, _, _ = view_planned(tier, entry.key, range(0, 4), None, 100, (torch.float32, (2, 16)))
    assert_same(k, entry.k)
    assert view_planned(tier, entry.key, layers, rows, num_rows, form) is None
