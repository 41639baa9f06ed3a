"""Epic's attention-sink observation (Epic Fig. 4), measured on this model: under naive reuse every chunk was
compiled at position 0, so its first tokens absorb attention (a sink per chunk); full prefill does not do this,
and LegoLink, by recomputing those tokens (or compiling chunks behind dummy tokens), should remove it.

Measured as the share of the question's attention (the fresh rows, which every method computes) on the first
tokens of the chunks, per layer, for each method.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import torch

from kvreuse.eval.analyses.output import AnalysisSettings
from kvreuse.eval.analyses.probe import ExampleProbe, attention_mass

METHODS = ("full", "naive", "legolink:2", "legolink:16", "legolink0", "cacheblend:0.15", "cachetune:0.15")
INITIAL_TOKENS = 1  # a chunk's first token: where a chunk compiled alone puts its sink


def chunk_sinks(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    """Per method: the question's attention mass on chunk-initial tokens per layer (mean over examples), its mean
    over layers, and the mass on the prompt's own first token for comparison."""
    on_starts: dict[str, list[torch.Tensor]] = {}
    on_first: dict[str, list[float]] = {}
    kl: dict[str, list[float]] = {}
    chunks: list[int] = []
    for probe in probes:
        chunks.append(len(probe.chunks))
        starts = probe.chunk_starts(INITIAL_TOKENS)
        for method in METHODS:
            observed = probe.full if method == "full" else probe.run_method(method)
            on_starts.setdefault(method, []).append(attention_mass(observed.attention, starts))
            on_first.setdefault(method, []).append(float(attention_mass(observed.attention, torch.tensor([0])).mean()))
            kl.setdefault(method, []).append(probe.fidelity(observed)["first_token_kl"])
    return {
        "initial_tokens_per_chunk": INITIAL_TOKENS,
        "chunks_per_example": statistics.fmean(chunks),
        "methods": {
            method: {
                "mass_on_chunk_starts_per_layer": torch.stack(masses).mean(0).tolist(),
                "mass_on_chunk_starts_mean": float(torch.stack(masses).mean()),
                "mass_on_prompt_start_mean": statistics.fmean(on_first[method]),
                "first_token_kl": statistics.fmean(kl[method]),
            }
            for method, masses in on_starts.items()
        },
    }


def draw_chunk_sinks(figure, numbers: dict) -> None:
    by_layer, overall = figure.subplots(1, 2, width_ratios=[1.6, 1])
    names = list(numbers["methods"])
    for i, (method, m) in enumerate(numbers["methods"].items()):
        by_layer.plot(m["mass_on_chunk_starts_per_layer"], marker=".", label=method, color=f"C{i}")
    by_layer.set_xlabel("layer")
    by_layer.set_ylabel("question's attention on the chunks' first tokens")
    by_layer.legend(fontsize=8)
    by_layer.grid(alpha=0.3)
    overall.barh(range(len(names)), [numbers["methods"][n]["mass_on_chunk_starts_mean"] for n in names],
                 color=[f"C{i}" for i in range(len(names))])
    overall.set_yticks(range(len(names)), names, fontsize=8)
    overall.invert_yaxis()
    overall.set_xlabel("mean over layers")
    overall.grid(alpha=0.3, axis="x")
    chunks, tokens = numbers["chunks_per_example"], numbers["initial_tokens_per_chunk"]
    figure.suptitle(f"Epic Fig. 4 on SmolLM2-135M: attention sinks at chunk starts ({chunks:.0f} chunks, "
                    f"first {tokens} token each)")
