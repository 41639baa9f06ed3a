"""Segmented LRU over byte sizes: the replacement policy of the capacity-limited tiers.

New keys enter a probationary segment; a hit there moves the key to the protected segment. Eviction takes the
probationary LRU first, so a burst of one-off chunks (RAG traffic) churns probation and leaves the chunks that
were hit twice alone. When protected outgrows its share, its LRU drops back to probation rather than out.
"""

from __future__ import annotations

from collections import OrderedDict


class SegmentedLRU:
    def __init__(self, capacity: int | None, protected_share: float = 0.8):
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive bytes, got {capacity}")
        self.capacity = capacity
        self.protected_capacity = None if capacity is None else int(capacity * protected_share)
        self.probation: OrderedDict[str, int] = OrderedDict()
        self.protected: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.protected_used = 0

    def __contains__(self, key: str) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def room_left(self) -> int | None:
        return None if self.capacity is None else max(self.capacity - self.used, 0)

    def fits(self, size: int) -> bool:
        return self.capacity is None or size <= self.capacity

    def admit(self, key: str, size: int) -> list[str]:
        """Insert `key` (which must fit) on probation; returns the keys evicted to make room."""
        assert self.fits(size), "caller checks fits() first"
        self.remove(key)
        self.probation[key] = size
        self.used += size
        return self._evict_over_capacity(keep=key)

    def adopt(self, key: str, size: int) -> None:
        """Insert `key` on probation without evicting anything, even past capacity (an entry found on opening a
        store: opening must not delete, the next admit evicts down to capacity)."""
        self.remove(key)
        self.probation[key] = size
        self.used += size

    def touch(self, key: str) -> None:
        """Record a hit: a probationary key is promoted, a protected one refreshed."""
        if key in self.protected:
            self.protected.move_to_end(key)
        elif key in self.probation:
            self.protected[key] = self.probation.pop(key)
            self.protected_used += self.protected[key]
            self._demote_over_protected_share()

    def remove(self, key: str) -> None:
        size = self.probation.pop(key, None)
        if size is None and key in self.protected:
            size = self.protected.pop(key)
            self.protected_used -= size
        if size is not None:
            self.used -= size

    def forget_all(self) -> None:
        """Every key gone at once (their files deleted by someone else), nothing evicted."""
        self.probation.clear()
        self.protected.clear()
        self.used = self.protected_used = 0

    def _demote_over_protected_share(self) -> None:
        if self.protected_capacity is None:
            return
        while self.protected_used > self.protected_capacity:
            key, size = self.protected.popitem(last=False)
            self.protected_used -= size
            self.probation[key] = size

    def _evict_over_capacity(self, keep: str) -> list[str]:
        evicted = []
        while self.capacity is not None and self.used > self.capacity:
            # `keep` (just admitted) sits at probation's MRU end, so it is reached last.
            segment = self.probation if any(k != keep for k in self.probation) else self.protected
            key = next(k for k in segment if k != keep)
            self.remove(key)
            evicted.append(key)
        return evicted
