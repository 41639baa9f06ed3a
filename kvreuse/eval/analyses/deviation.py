"""CacheBlend's two observations on KV deviation, measured on this model.

`hkvd` (CacheBlend Fig. 6): attention deviation from full prefill as the recompute ratio grows, when the
recomputed tokens are those of highest KV deviation (HKVD, an oracle ranking from full prefill), CacheBlend's
own gradual filtering (which finds them online), or a random set.

`layer-correlation` (CacheBlend Fig. 8): Spearman rank correlation of the per-token KV deviation of naive reuse
between neighbouring layers; a high correlation is why a token set chosen on an early layer serves later ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import torch

from kvreuse.eval.analyses.output import AnalysisSettings
from kvreuse.eval.analyses.probe import ExampleProbe

RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Rank of each element (0 = smallest); ties, which float deviations almost never have, rank by position."""
    result = torch.empty(x.numel(), dtype=torch.float64)
    result[x.argsort(stable=True)] = torch.arange(x.numel(), dtype=torch.float64)
    return result


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks."""
    ra, rb = ranks(a) - (a.numel() - 1) / 2, ranks(b) - (b.numel() - 1) / 2
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def top_rows(scores: torch.Tensor, rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """The `ratio` share of `rows` with the highest `scores` (one score per row), sorted."""
    return rows[scores.topk(round(ratio * rows.numel())).indices].sort().values


def random_rows(rows: torch.Tensor, ratio: float, generator: torch.Generator) -> torch.Tensor:
    return rows[torch.randperm(rows.numel(), generator=generator)[: round(ratio * rows.numel())]].sort().values


def hkvd(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    """Per selection and ratio: attention deviation, KV deviation and first-token KL, averaged over examples."""
    generator = torch.Generator().manual_seed(settings.seed)
    curves: dict[str, dict[str, list]] = {}
    for probe in probes:
        deviation = probe.kv_deviation(probe.run_method("naive")).sum(0)  # the oracle: over all layers
        for ratio in RATIOS:
            runs = {
                "HKVD (oracle ranking)": lambda: probe.run_rows(top_rows(deviation, probe.chunk_rows, ratio)),
                "random": lambda: probe.run_rows(random_rows(probe.chunk_rows, ratio, generator)),
                # CacheBlend's layer 0 is always recomputed in full: r = 0 is not one of its settings
                "CacheBlend gradual filtering": (lambda: probe.run_method(f"cacheblend:{ratio}")) if ratio else None,
            }
            for selection, run in runs.items():
                if run is not None:
                    curve = curves.setdefault(selection, {})
                    curve.setdefault(str(ratio), []).append(probe.fidelity(run()))
    return {"ratios": list(RATIOS), "curves": {s: _mean_by_ratio(c) for s, c in curves.items()}}


def _mean_by_ratio(by_ratio: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {
        ratio: {metric: statistics.fmean(r[metric] for r in runs) for metric in runs[0]}
        for ratio, runs in by_ratio.items()
    }


def draw_hkvd(figure, numbers: dict) -> None:
    panels = [
        ("attention_deviation", "attention deviation from full\n(L2 per query row, mean over layers)"),
        ("kv_deviation", "KV deviation from full (L2 per token, mean)"),
        ("first_token_kl", "first-token KL from full (nats)"),
    ]
    axes = figure.subplots(1, len(panels))
    for ax, (metric, label) in zip(axes, panels):
        for selection, curve in numbers["curves"].items():
            ratios = [float(r) for r in curve]
            ax.plot(ratios, [point[metric] for point in curve.values()], marker="o", label=selection)
        ax.set_xlabel("recompute ratio r (share of chunk tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle("CacheBlend Fig. 6 on SmolLM2-135M: deviation vs recompute ratio, HKVD vs random")


def layer_correlation(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    """Per neighbouring layer pair: Spearman of naive reuse's per-token KV deviation, and how much of one
    layer's top-`ratio` HKVD set is also the next layer's."""
    correlations, overlaps, layer0 = [], [], []
    for probe in probes:
        deviation = probe.kv_deviation(probe.run_method("naive"))  # [layers, chunk tokens]
        layer0.append(float(deviation[0].max()))
        # layer 0's K and V depend on the token alone, so naive reuse is exact there: no ranking to correlate
        pairs = range(1, deviation.shape[0] - 1)
        correlations.append([spearman(deviation[i], deviation[i + 1]) for i in pairs])
        top = [set(top_rows(d, probe.chunk_rows, settings.ratio).tolist()) for d in deviation]
        overlaps.append([len(top[i] & top[i + 1]) / max(1, len(top[i])) for i in pairs])
    return {
        "layer_pairs": [f"{i}-{i + 1}" for i in range(1, len(correlations[0]) + 1)],
        "hkvd_ratio": settings.ratio,
        "spearman_per_example": correlations,
        "spearman_mean": [statistics.fmean(c) for c in zip(*correlations)],
        "top_set_overlap_mean": [statistics.fmean(o) for o in zip(*overlaps)],
        "layer0_max_deviation": max(layer0),
    }


def draw_layer_correlation(figure, numbers: dict) -> None:
    ax = figure.subplots()
    x = range(1, len(numbers["layer_pairs"]) + 1)
    for example in numbers["spearman_per_example"]:
        ax.plot(x, example, color="0.75", linewidth=0.8)
    ax.plot(x, numbers["spearman_mean"], marker="o", color="C0", label="Spearman (mean over examples; grey: each)")
    kept = f"share of layer i's top {numbers['hkvd_ratio']:.0%} (its HKVD set) also in layer i+1's"
    ax.plot(x, numbers["top_set_overlap_mean"], marker="s", color="C1", label=kept)
    ax.set_xticks(list(x), numbers["layer_pairs"], rotation=60, fontsize=8)
    ax.set_xlabel("neighbouring layers")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    figure.suptitle("CacheBlend Fig. 8 on SmolLM2-135M: rank correlation of per-token KV deviation (naive reuse)")
