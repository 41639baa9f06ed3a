"""Per-tier recompute ratios, chosen once per machine and stored in its profile.

- CacheTune: a warm-started golden-section search (kvreuse.controller.search) of the ratio with the lowest mean
  measured TTFT over a small calibration set, from the roofline prior r0 = t_i / (t_c + t_i).
- CacheBlend: its rule, the ratio whose recompute just hides the load, from the cost model.

The calibration set is synthetic (random words in chunks of passage size): a ratio's TTFT depends on the
shape of the request, not on what the text says, and the product must not need a dataset at run time.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvreuse.controller.cost import predict
from kvreuse.controller.profile import MachineProfile
from kvreuse.controller.search import cacheblend_ratio, golden_section, roofline_ratio
from kvreuse.fusion.segments import Request

RATIO_FLOOR = 0.15  # CacheTune's and CacheBlend's quality floor on the ratio


@dataclass(frozen=True)
class CalibrationShape:
    chunks: int = 10  # a RAG prompt of ten passages, as in the QA datasets
    words_per_chunk: int = 120  # about 160 tokens
    requests: int = 2


def synthetic_requests(build_request: Callable[[list[str], str], Request], tokenizer,
                       shape: CalibrationShape = CalibrationShape(), seed: int = 0) -> list[Request]:
    words = sorted(w.lstrip("Ġ") for w in tokenizer.get_vocab() if w.lstrip("Ġ").isalpha() and len(w) > 3)
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    return [build_request([text(shape.words_per_chunk) for _ in range(shape.chunks)], text(12) + "?")
            for _ in range(shape.requests)]


def tune_cachetune(measure_ttft: Callable[[str], float], profile: MachineProfile, tier: str,
                   tol: float = 0.02) -> float:
    """measure_ttft(method) -> mean TTFT of the calibration set under `method`, chunks on `tier`."""
    r0 = roofline_ratio(profile.compute.t_c, profile.t_i(tier), floor=RATIO_FLOOR)
    result = golden_section(lambda r: measure_ttft(f"cachetune:{r:.4f}"), RATIO_FLOOR, 1.0, warm_start=r0, tol=tol)
    return round(result.x, 4)


def cacheblend_rule(plan_on_tiers: Callable[[str], tuple], profile: MachineProfile) -> float:
    """max(the ratio whose per-layer recompute hides the per-layer load, the floor), for one request's plan."""
    layers = profile.num_layers

    def prediction(ratio: float):
        return predict(*plan_on_tiers(f"cacheblend:{ratio:.4f}"), profile)

    load = prediction(RATIO_FLOOR).load_seconds / layers
    return round(cacheblend_ratio(load, lambda r: prediction(r).compute_seconds / layers, floor=RATIO_FLOOR), 4)


def calibrated(profile: MachineProfile, tier: str, cachetune: float, cacheblend: float) -> MachineProfile:
    return replace(profile, tuned_ratios={**profile.tuned_ratios, f"cachetune@{tier}": cachetune,
                                          f"cacheblend@{tier}": cacheblend})


def mean_ttft(prefill: Callable[[Request, str], float], requests: list[Request], repeats: int
              ) -> Callable[[str], float]:
    """The objective of the search: per request the best of `repeats` prefills, averaged over the set."""
    return lambda method: statistics.fmean(min(prefill(r, method) for _ in range(repeats)) for r in requests)
