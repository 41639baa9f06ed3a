"""What this machine costs, per model and dtype: the numbers the controller's cost model runs on.

CacheTune's t_c (recompute cost per token per layer), t_o (fixed per-layer overhead) and t_i (read cost per
token per layer, per tier) are the linear summary; the cost model uses the finer measured curves behind them,
since on a CPU a matmul over 64 rows runs at about half the rate of one over 2048 (kvreuse/docs/RESULTS.md).
`kvreuse profile` measures a profile (kvreuse.controller.measure) and saves it as JSON in the kvreuse cache
folder; the server and `method: auto` read it back.
"""

from __future__ import annotations

import json
import logging
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvreuse.model.identity import cache_root, save_json
from kvreuse.model.attention import AttentionCall

log = logging.getLogger(__name__)


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
        """A profile read back; ValueError names what makes it unusable (a damaged or hand-edited file)."""
        try:
            profile = cls(**{**data, "compute": ComputeProfile(**data["compute"]),
                             "tiers": {name: TierProfile(**t) for name, t in data["tiers"].items()}})
            problem = profile._problem()
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a kvreuse machine profile: {e}") from None
        if problem:
            raise ValueError(f"not a usable kvreuse machine profile: {problem}")
        return profile

    def _problem(self) -> str | None:
        """What the cost model could not run on: a grid it cannot interpolate, a time or bandwidth it would
        divide by or add that is not a finite number of its sign, a window list of another model."""
        c = self.compute
        grid_ok = (len(c.rows) >= 2 and len(c.dense_seconds) == len(c.rows) and all(map(_count, c.rows))
                   and all(a < b for a, b in zip(c.rows, c.rows[1:])))
        times = [*c.dense_seconds, c.score_seconds, c.key_seconds, c.call_seconds, c.place_seconds,
                 c.request_seconds, c.causal_seconds_per_score, *(t.latency_seconds for t in self.tiers.values())]
        checks = {
            "compute.rows: expected 2 or more increasing row counts, one dense_seconds each": grid_ok,
            "a time that is not a finite number >= 0": all(map(_non_negative, times)),
            "compute.qkv_share: expected a share in [0, 1]": _non_negative(c.qkv_share) and c.qkv_share <= 1,
            "a tier's bytes_per_second: expected a finite number > 0":
                all(_non_negative(t.bytes_per_second) and t.bytes_per_second > 0 for t in self.tiers.values()),
            "num_layers and kv_bytes_per_token_layer: expected whole numbers > 0":
                _count(self.num_layers) and _count(self.kv_bytes_per_token_layer),
            "windows: expected one per layer, each a whole number > 0 or null":
                len(self.windows) in (0, self.num_layers) and all(w is None or _count(w) for w in self.windows),
            "tuned_ratios: expected shares in [0, 1]":
                all(_non_negative(r) and r <= 1 for r in self.tuned_ratios.values()),
        }
        return next((problem for problem, ok in checks.items() if not ok), None)


def _non_negative(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.warning("machine profile %s is unusable (%s): it is measured again", path, e)
        return None
    ours = (profile.model, profile.dtype, profile.runtime_revision) == (model, dtype, RUNTIME_REVISION)
    return profile if ours else None
