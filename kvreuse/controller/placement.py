"""Which store tier a new entry goes to.

CacheBlend (paper 001, loading controller) stores KV on "the cheapest storage device where T_recompute >= T_load":
the store's layer loop reads layer i+1 while it computes layer i, so a slow device costs no TTFT as long as one
layer's read of the entry takes no longer than one layer's recompute of the rows requests recompute alongside it.
Here the tiers run fastest to slowest and the slowest counts as the cheapest, so an entry goes to the slowest
tier with room whose read hides, and stays in memory (tier 0) when none does. A hot entry stays in memory too:
its next hit should not wait on a device, and freeing memory for it is the LRU's job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvreuse.controller.profile import MachineProfile
from kvreuse.model.attention import attention_calls

MEMORY = 0  # index of the fastest tier


@dataclass(frozen=True)
class PlacementPolicy:
    hot_hits: int = 2  # an entry hit this often is kept in memory whatever its load costs elsewhere

    def __post_init__(self):
        if self.hot_hits < 1:
            raise ValueError(f"hot_hits must be at least 1, got {self.hot_hits}")


@dataclass(frozen=True)
class NewEntry:
    """A store entry about to be written, and how requests will use it."""

    tokens: int
    ratio: float  # share of its rows requests recompute (the rest is loaded)
    context_rows: int = 0  # rows a request recomputes beside the entry's own: fresh tokens, other chunks' picks
    hits: int = 0

    def __post_init__(self):
        if self.tokens < 1:
            raise ValueError(f"tokens must be at least 1, got {self.tokens}")
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be a share in [0, 1], got {self.ratio}")
        if self.context_rows < 0:
            raise ValueError(f"context_rows must be non-negative, got {self.context_rows}")
        if self.hits < 0:
            raise ValueError(f"hits must be non-negative, got {self.hits}")


@dataclass(frozen=True)
class Placement:
    tier: int  # index into the tiers given, fastest first
    reason: str  # for logs and stats


def choose_tier(profile: MachineProfile, tiers: Sequence[tuple[str, int | None]], entry: NewEntry,
                policy: PlacementPolicy = PlacementPolicy()) -> Placement:
    """`tiers`: (profiled tier name, free bytes or None for unbounded), fastest first."""
    _check_tiers(profile, tiers)
    if len(tiers) == 1:
        return Placement(MEMORY, "only tier")
    if entry.hits >= policy.hot_hits:
        return Placement(MEMORY, f"hot: {entry.hits} hits")
    compute = recompute_seconds_per_layer(profile, entry)
    size = entry.tokens * profile.kv_bytes_per_token_layer * profile.num_layers
    for index in range(len(tiers) - 1, MEMORY, -1):
        name, free = tiers[index]
        read = profile.tiers[name].read_seconds(entry.tokens * profile.kv_bytes_per_token_layer, reads=1)
        if (free is None or free >= size) and read <= compute:
            return Placement(index, f"{name}: read {_ms(read)}/layer hides behind recompute {_ms(compute)}/layer")
    return Placement(MEMORY, f"no slower tier with room hides its read behind recompute {_ms(compute)}/layer")


def recompute_seconds_per_layer(profile: MachineProfile, entry: NewEntry) -> float:
    """One layer's compute while the next layer's read of the entry runs: its recomputed rows (spread over it)
    and the context rows (after it), and placing its loaded rows. Attention sees only the entry and the context
    rows, a lower bound, so a slow tier is chosen only when it surely hides."""
    own_rows = math.ceil(entry.ratio * entry.tokens)
    positions = torch.cat([torch.linspace(0, entry.tokens - 1, own_rows).long(),
                           torch.arange(entry.tokens, entry.tokens + entry.context_rows)])
    calls = attention_calls(positions, torch.arange(entry.tokens + entry.context_rows), None) if own_rows or \
        entry.context_rows else []
    return profile.compute.layer_seconds(positions.numel(), calls, placed=entry.tokens - own_rows)


def _check_tiers(profile: MachineProfile, tiers: Sequence[tuple[str, int | None]]) -> None:
    if not tiers:
        raise ValueError("tiers must name at least one tier")
    for name, free in tiers:
        if name not in profile.tiers:
            raise ValueError(f"tier {name!r} is not in the machine profile (profiled: {sorted(profile.tiers)})")
        if free is not None and free < 0:
            raise ValueError(f"free bytes of tier {name!r} must be non-negative, got {free}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
