"""method auto on synthetic profiles and a fixed fidelity table: which plan wins, and why."""

from __future__ import annotations

import pytest

from kvreuse.controller.auto import AutoController
from kvreuse.controller.fidelity import Fidelity, FidelityTable
from kvreuse.controller.profile import TierProfile
from kvreuse.fusion.methods import parse_method

from .support import KV_BYTES, TIERS, rag_plan, synthetic_profile

# the shape of SmolLM2's measured table (docs/RESULTS.md)
TABLE = FidelityTable("synthetic", {
    "naive": Fidelity(0.39, 0.43), "legolink:16": Fidelity(0.21, 0.52), "cacheblend:0.15": Fidelity(0.147, 0.54),
    "cacheblend:0.3": Fidelity(0.063, 0.70), "full": Fidelity(0.0, 1.0), "prefix": Fidelity(0.0, 1.0)})
PER_ROW = 1e-5  # dense compute per row per layer


def choose(method: str, tier: str = "memory", table: FidelityTable | None = TABLE, **profile_options) -> str:
    controller = AutoController(synthetic_profile(PER_ROW, **profile_options), table)
    return controller.choose(parse_method(method), lambda m: rag_plan(m, tier)).method


def test_from_memory_the_fastest_method_meeting_the_default_floor():
    assert choose("auto") == "cacheblend:0.15"  # naive and legolink:16 are faster but miss KL 0.15


@pytest.mark.parametrize("floor, expected", [
    ("auto:kl=0.1", "cacheblend:0.3"), ("auto:0.25", "legolink:16"), ("auto:kl=0.5", "naive"),
    ("auto:agreement=0.6", "cacheblend:0.3"), ("auto:kl=0.01", "prefix")])
def test_the_floor_decides_which_methods_may_run(floor, expected):
    assert choose(floor) == expected


def test_when_loading_dominates_the_tie_goes_to_the_more_faithful_ratio():
    # reading the 1000 chunk rows of a layer takes 5 ms; recomputing 30% of them 3 ms: both ratios wait on reads
    slow = {"slow": TierProfile("slow", 1000 * KV_BYTES / 5e-3, 0.0)}
    assert choose("auto", "slow", tiers=slow) == "cacheblend:0.3"


def test_a_tier_slower_than_recomputing_everything_gets_the_exact_plan():
    crawl = {"crawl": TierProfile("crawl", 1000 * KV_BYTES / 1.0, 0.0)}  # a second per layer
    assert choose("auto", "crawl", tiers=crawl) == "prefix"


def test_without_a_fidelity_table_only_exact_plans_qualify():
    assert choose("auto:kl=0.5", table=None) == "prefix"


def test_a_ratio_tuned_for_the_tier_is_tried_with_the_fidelity_below_it():
    profile = synthetic_profile(PER_ROW, tiers=TIERS)
    tuned = AutoController(profile.__class__(**{**profile.__dict__, "tuned_ratios": {"cacheblend@memory": 0.2}}),
                           TABLE)
    admitted = tuned.admitted(parse_method("auto"), "memory")
    assert admitted["cacheblend:0.2"] == TABLE.methods["cacheblend:0.15"]
    choice = tuned.choose(parse_method("auto"), lambda m: rag_plan(m, "memory"))
    assert {c.method for c in choice.candidates} == {"cacheblend:0.15", "cacheblend:0.2", "cacheblend:0.3", "prefix"}
    assert choice.candidates == sorted(choice.candidates, key=lambda c: c.prediction.seconds)
    assert choice.method == "cacheblend:0.15" and choice.predicted_seconds == choice.candidates[0].prediction.seconds


def test_rows_auto_cannot_plan_are_never_candidates():
    """A table built in code may hold what an eval ran (auto itself, another dtype): auto skips them."""
    table = FidelityTable("synthetic", {**TABLE.methods, "auto": Fidelity(0.0, 1.0),
                                        "naive@bfloat16": Fidelity(0.0, 1.0), "magic": Fidelity(0.0, 1.0)})
    assert set(AutoController(synthetic_profile(PER_ROW), table).admitted(parse_method("auto:kl=0.5"))) == {
        "naive", "legolink:16", "cacheblend:0.15", "cacheblend:0.3", "prefix"}
    assert choose("auto", table=table) == "cacheblend:0.15"
