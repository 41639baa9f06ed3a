"""Scan resistance: a burst of one-off chunks must not flush the chunks that are used again."""

from __future__ import annotations

import pytest

from kvreuse.store.policy import SegmentedLRU


def run_workload(protected_share: float) -> set[str]:
    """10-entry cache, 4 hot keys used twice, then a burst of 50 one-off keys; returns the hot keys left."""
    lru = SegmentedLRU(capacity=10 * 100, protected_share=protected_share)
    hot = [f"hot{i}" for i in range(4)]
    for key in hot:
        lru.admit(key, 100)
        lru.touch(key)
    for i in range(50):
        lru.admit(f"scan{i}", 100)
    return {key for key in hot if key in lru}


def test_hot_keys_survive_a_scan():
    assert run_workload(protected_share=0.8) == {"hot0", "hot1", "hot2", "hot3"}


def test_plain_lru_would_lose_them():
    # Same workload with no protected segment: the baseline this policy exists to beat.
    assert run_workload(protected_share=0.0) == set()


def test_byte_budget_and_segments():
    lru = SegmentedLRU(capacity=1000, protected_share=0.5)
    assert lru.admit("a", 400) == [] and lru.admit("b", 400) == []
    lru.touch("a")
    lru.touch("b")  # protected holds 500 at most: "a" drops back to probation
    assert list(lru.protected) == ["b"] and list(lru.probation) == ["a"]
    assert lru.admit("c", 400) == ["a"]
    assert lru.used == 800 and not lru.fits(1001)
    lru.remove("b")
    assert lru.used == 400 and len(lru) == 1
    with pytest.raises(ValueError, match="capacity"):
        SegmentedLRU(0)
