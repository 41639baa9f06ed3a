"""The per-request fidelity signal (issue 19): do the KV deviation CacheBlend measures at its first check layer,
or the uncertainty of the method's own first-token distribution, predict how far a request's reuse strays from
full prefill, and what does a residual guard (method `guarded:d`) buy at each bound? Each signal's rank correlation
with first-token KL is reported on the odd examples alone, the even ones left to whoever picks a threshold from
these figures (needs at least 6 examples: `--limit` defaults to 20 here).

Timings are the fusion executor's alone (no attention observer), each method's against full prefill's on the
same example in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from kvreuse.eval.analyses.deviation import spearman
from kvreuse.eval.analyses.output import AnalysisSettings
from kvreuse.eval.analyses.probe import ExampleProbe
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.methods import DEFAULT_MAX_KL, DEFAULT_METHOD, parse_method

FLOOR = DEFAULT_MAX_KL
GUARDS = ("guarded:1e-3", "guarded:5e-4", "guarded:2.5e-4",
          "guarded-query:2e-3", "guarded-query:1e-3", "guarded-query:5e-4")
BASELINES = ("naive", "cacheblend:0.15", DEFAULT_METHOD)
# The per-request signals, each measured by the request itself: the first check's deviation mass (of CacheBlend's
# check, plain or weighted by the question's attention), or how unsure the method's own first token is (1 - its top
# probability: a shifted distribution moves KL little where one token takes nearly all of it).
SIGNALS = {
    "deviation mass": lambda runs, method: runs["cacheblend:0.15"]["deviation_mass"],
    "question-weighted mass": lambda runs, method: runs["guarded-query:2e-3"]["deviation_mass"],
    "output uncertainty": lambda runs, method: runs[method]["uncertainty"],
}


def _run(probe: ExampleProbe, method: str) -> tuple[dict, float]:
    policy = parse_method(method)
    plan = policy.plan(probe.request, probe.engine.lookup(probe.request, policy))
    started = time.perf_counter()
    result = probe.engine.executor.run(plan, probe.request.token_ids)
    return result.stats.record() | {"logits": result.logits}, time.perf_counter() - started


def fidelity_signal(probes: Iterable[ExampleProbe], settings: AnalysisSettings) -> dict:
    examples = []
    for probe in probes:
        full, full_seconds = _run(probe, "full")
        runs = {}
        for method in (*BASELINES, *GUARDS):
            stats, seconds = _run(probe, method)
            runs[method] = {"kl": first_token_kl(full["logits"], stats["logits"]), "speedup": full_seconds / seconds,
                            "recompute_share": stats["recompute_share"], "deviation_mass": stats["deviation_mass"],
                            "deviation_residual": stats["deviation_residual"],
                            "uncertainty": 1 - float(stats["logits"].double().softmax(-1).max())}
        examples.append({"id": probe.prompt.id, "tokens": len(probe.request), "methods": runs})
    held_out = examples[1::2]
    return {
        "floor": FLOOR,
        "held_out_spearman": {
            signal: {method: held_out_spearman([value(e["methods"], method) for e in held_out],
                                               [e["methods"][method]["kl"] for e in held_out])
                     for method in BASELINES}
            for signal, value in SIGNALS.items()},
        "summary": {method: summarise([e["methods"][method] for e in examples]) for method in examples[0]["methods"]},
        "examples": examples,
    }


def summarise(runs: list[dict]) -> dict:
    return {"mean_kl": statistics.fmean(r["kl"] for r in runs),
            "share_above_floor": sum(r["kl"] > FLOOR for r in runs) / len(runs),
            "mean_speedup": statistics.fmean(r["speedup"] for r in runs),
            "mean_recompute_share": statistics.fmean(r["recompute_share"] for r in runs)}


def held_out_spearman(signal: list[float], kl: list[float]) -> float | None:
    return spearman(torch.tensor(signal), torch.tensor(kl)) if len(signal) >= 3 else None


def draw_fidelity_signal(figure, numbers: dict) -> None:
    figure.set_size_inches(16, 5)
    left, middle, right = figure.subplots(1, 3)
    _draw_signal(left, numbers, "deviation mass", "layer-1 KV deviation mass (relative to the stored KV's energy)")
    _draw_signal(middle, numbers, "output uncertainty", "1 - the method's top first-token probability")
    summary = numbers["summary"]
    for method, row in summary.items():
        right.scatter(row["mean_speedup"], row["share_above_floor"])
        right.annotate(method, (row["mean_speedup"], row["share_above_floor"]), fontsize=8)
    right.set(xlabel="mean speedup over full prefill (executor time)", ylabel=f"share of examples with KL > {FLOOR}",
              title="speed vs the per-request bound")


def _draw_signal(axis, numbers: dict, signal: str, label: str) -> None:
    held_out = numbers["examples"][1::2]
    for method, colour in zip(numbers["held_out_spearman"][signal], ("tab:red", "tab:blue", "tab:green")):
        rho = numbers["held_out_spearman"][signal][method]
        axis.scatter([SIGNALS[signal](e["methods"], method) for e in held_out],
                     [e["methods"][method]["kl"] for e in held_out], color=colour,
                     label=f"{method} (held out, Spearman {rho:.2f})" if rho is not None else method)
    axis.axhline(numbers["floor"], color="grey", linestyle="--", label="floor")
    axis.set(xlabel=label, ylabel="first-token KL vs full prefill", title=f"the request's own signal: {signal}")
    axis.legend(fontsize=7)
