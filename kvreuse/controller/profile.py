"""What this machine costs, per model and dtype: the numbers the controller's cost model runs on.

CacheTune's t_c (recompute cost per token per layer), t_o (fixed per-layer overhead) and t_i (read cost per
token per layer, per tier) are the linear summary; the cost model uses the finer measured curves behind them,
since on a CPU a matmul over 64 rows runs at about half the rate of one over 2048 (kvreuse/docs/RESULTS.md).
`kvreuse profile` measures a profile (kvreuse.controller.measure) and saves it as JSON in the kvreuse cache
folder; the server and `method: auto` read it back.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvreuse.model.identity import cache_root, save_json
from kvreuse.model.attention import AttentionCall


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds the executor spends per layer, as measured on this machine."""

    rows: list[int]  # grid of computed row counts, increasing
    dense_seconds: list[float]  # per layer: projections, RoPE, norms and MLP of that many rows
    score_seconds: float  # attention, per query-key score a kernel call computes
    key_seconds: float  # attention, per key row a kernel call reads
    call_seconds: float  # attention, per kernel call
    place_seconds: float  # per layer, per loaded row: rotate its stored key and write it into the fresh cache
    request_seconds: float  # per request: lookups, plan, embedding, final norm and logits
    qkv_share: float  # the share of the dense time spent projecting q, k and v
    # per score of a causal kernel call, which skips masked blocks and runs faster per score than a masked one
    # (None: as score_seconds, in profiles measured before the two were told apart)
    causal_score_seconds: float | None = None

    def dense(self, rows: int) -> float:
        """Interpolated linearly between grid points; extrapolated from the last two beyond the grid."""
        if rows <= 0:
            return 0.0
        grid, seconds = self.rows, self.dense_seconds
        if rows <= grid[0]:
            return seconds[0] * rows / grid[0]
        i = min(max(bisect_left(grid, rows), 1), len(grid) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (grid[i] - grid[i - 1])
        return seconds[i - 1] + slope * (rows - grid[i - 1])

    def attention(self, calls: list[AttentionCall]) -> float:
        """One layer's attention, run as these kernel calls (kvreuse.model.attention.attention_calls)."""
        causal = self.causal_seconds_per_score
        return sum(c.causal_scores * causal + c.plain_scores * self.score_seconds + (c.hi - c.lo) * self.key_seconds
                   + self.call_seconds * (2 if c.diagonal else 1) for c in calls)

    @property
    def causal_seconds_per_score(self) -> float:
        return self.score_seconds if self.causal_score_seconds is None else self.causal_score_seconds

    def layer_seconds(self, rows: int, attention: list[AttentionCall], placed: int = 0) -> float:
        """One layer computing `rows` rows, attending with `attention`, after placing `placed` loaded rows."""
        return self.dense(rows) + self.attention(attention) + placed * self.place_seconds

    @property
    def t_c(self) -> float:
        """Recompute cost per token per layer: the slope of the dense curve over the largest grid span."""
        return (self.dense_seconds[-1] - self.dense_seconds[0]) / (self.rows[-1] - self.rows[0])

    @property
    def t_o(self) -> float:
        """Fixed per-layer overhead: the dense curve's intercept at zero rows."""
        return max(0.0, self.dense_seconds[0] - self.t_c * self.rows[0])


@dataclass(frozen=True)
class TierProfile:
    """A store tier's read cost: every read pays `latency_seconds`, then its bytes at `bytes_per_second`."""

    name: str
    bytes_per_second: float
    latency_seconds: float
    emulated: bool = False  # an emulated device: the figures come from its model, not from a device
    reads_wait: bool = True  # its reads wait (device, network), so the executor overlaps them with compute

    def read_seconds(self, nbytes: float, reads: int = 1) -> float:
        return reads * self.latency_seconds + nbytes / self.bytes_per_second


@dataclass(frozen=True)
class MachineProfile:
    model: str  # the model's fingerprint
    dtype: str
    num_layers: int
    kv_bytes_per_token_layer: int  # stored K and V of one token in one layer
    compute: ComputeProfile
    tiers: dict[str, TierProfile] = field(default_factory=dict)
    windows: list[int | None] = field(default_factory=list)  # sliding window of each layer (None: global)
    tuned_ratios: dict[str, float] = field(default_factory=dict)  # "method@tier" -> ratio, from calibration
    measured_at: str = ""
    runtime_revision: int = 0  # RUNTIME_REVISION when it was measured

    def t_i(self, tier: str) -> float:
        """Read cost per token per layer on `tier`, bandwidth only (latency is per read)."""
        return self.kv_bytes_per_token_layer / self.tiers[tier].bytes_per_second

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> MachineProfile:
        try:
            return cls(**{**data, "compute": ComputeProfile(**data["compute"]),
                          "tiers": {name: TierProfile(**t) for name, t in data["tiers"].items()}})
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a kvreuse machine profile: {e}") from None


# The compute kernels' revision: a profile measured under an earlier one prices compute the runtime no longer
# runs (2: projections in oneDNN, bf16 attention blocked; 3: a final run of queries attends by diagonal calls; 4:
# fp32 attention of several queries in the native prefill kernel; 5: that kernel 4-9% faster, and bf16's decoding
# attention and pointwise steps native; 6: bf16 attention of several queries in the native prefill kernel where
# built, in the bf16 dot-product instruction with AVX512-BF16; 7: the diagonal's unseen keys skipped, residuals
# added in the products, stored KV placed without a joined copy; 8: products of up to 48 rows over weights laid out
# in panels, fp32 and, with AVX512-BF16, bf16; 9: up to 1024 rows there; 10: with AVX2, up to 256 rows there, its
# loop not unrolled, and the prefill attention's values in tiles that fit its registers; 11: with AVX2, a tile in
# assembly and up to 2048 rows in panels; 12: with AVX2, a panel's later row tiles fetch the next panel), so it reads
# as missing and is measured again.
RUNTIME_REVISION = 12


def profile_path(model: str, dtype: str) -> Path:
    return cache_root() / "controller" / f"{model}-{dtype}.json"


def save_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    return save_json(path or profile_path(profile.model, profile.dtype), profile.to_json())


def merged(saved: MachineProfile, measured: MachineProfile) -> MachineProfile:
    """`measured` (compute and some tiers), keeping what `saved` knows that it lacks: the tiers not measured
    again, and every tuned ratio (a calibration outlives a new measurement of the same costs; --calibrate
    replaces it)."""
    tiers = {**saved.tiers, **measured.tiers}
    kept = {key: ratio for key, ratio in saved.tuned_ratios.items() if key.partition("@")[2] in tiers}
    return replace(measured, tiers=tiers, tuned_ratios={**kept, **measured.tuned_ratios})


def load_profile(model: str, dtype: str, path: Path | None = None) -> MachineProfile | None:
    """The saved profile of this model and dtype, or None if it was never measured, the file is unreadable, or
    it holds another model's or dtype's profile (a `path` given), or one measured under another runtime revision."""
    path = path or profile_path(model, dtype)
    try:
        profile = MachineProfile.from_json(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError, ValueError):
        return None
    ours = (profile.model, profile.dtype, profile.runtime_revision) == (model, dtype, RUNTIME_REVISION)
    return profile if ours else None
