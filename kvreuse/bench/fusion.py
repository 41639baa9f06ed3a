"""TTFT of every chunk-reuse method, per store tier, side by side in one run, with speedup over `full`, the
first-token KL from `full`, and the limit each method could reach (DESIGN.md, "Speed").

    kvreuse bench fusion --dataset ../shared/datasets/hotpotqa.jsonl --limit 10

For each example, its chunks are compiled into every tier first (not timed, as in the papers); then each repeat
runs full prefill once (it loads nothing: its row stands in every tier) and every (tier, method) pair in turn, so
load from elsewhere on the machine falls on all of them alike.
"""

from __future__ import annotations

import contextlib
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from kvreuse.bench.tiers import open_engines, report_name
from kvreuse.bench.timing import time_request, under_its_limit
from kvreuse.controller.auto import meets
from kvreuse.controller.cost import predict
from kvreuse.controller.fidelity import FidelityTable, expected_fidelity, load_table
from kvreuse.engine.reuse import ReuseEngine
from kvreuse.eval.datasets import load_dataset
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.methods import Auto, parse_method
from kvreuse.fusion.segments import Request
from kvreuse.model.loader import load_model

DEFAULT_METHODS = "full,naive,prefix,cacheblend:0.15,legolink:16,legolink0,cachetune:0.15"


@dataclass
class Cell:
    """One (tier, method): per-example median TTFT and what the runs reported."""

    ttft: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    limit: list[float] = field(default_factory=list)
    recompute_share: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # the controller's cost model, for the method run
    chosen: list[str] = field(default_factory=list)  # the method that ran (what auto resolved to)
    peak_layers_held: int = 0


def run(dataset: str, limit: int, methods: list[str], tiers: list[str], repeats: int, model: str | None) -> dict:
    loaded = load_model(model, "float32")
    prompts = load_dataset(dataset, limit=limit).prompts
    cells: dict[tuple[str, str], Cell] = defaultdict(Cell)
    lengths = []
    with contextlib.ExitStack() as stack:
        engines, specs = open_engines(loaded, tiers, stack)
        for prompt in prompts:
            request = next(iter(engines.values())).build_request(prompt.chunks, prompt.question)
            lengths.append(len(request))
            _run_example(engines, request, methods, repeats, cells)
    report = {"dataset": dataset, "examples": len(prompts), "prompt_tokens_mean": statistics.mean(lengths),
              "repeats": repeats, "specs": specs,
              "cells": {f"{t}|{m}": c.__dict__ for (t, m), c in cells.items()}}
    _print(report, methods, tiers, cells)
    print_auto_against_fixed(methods, tiers, cells, load_table(loaded.fingerprint))
    return report


def _run_example(engines: dict[str, ReuseEngine], request: Request, methods: list[str], repeats: int,
                 cells: dict[tuple[str, str], Cell]) -> None:
    timings = time_request(engines, request, methods, repeats)
    full = timings.full.last
    for tier, engine in engines.items():
        for method in methods:
            sample, limit = timings.of(tier, method)
            out, cell = sample.last, cells[tier, method]
            cell.ttft.append(sample.median)
            cell.kl.append(first_token_kl(full.logits, out.logits))
            fusion = out.stats.fusion
            cell.recompute_share.append(fusion.recompute_share)
            cell.peak_layers_held = max(cell.peak_layers_held, fusion.peak_stored_layers_held)
            cell.limit.append(limit)
            cell.chosen.append(fusion.method)
            plan, span_tiers = engine.plan_on_tiers(request, fusion.method)
            cell.predicted.append(predict(plan, span_tiers, engine.controller.profile).seconds)


def _print(report: dict, methods: list[str], tiers: list[str], cells: dict[tuple[str, str], Cell]) -> None:
    table = Table(title=f"Chunk reuse TTFT, {report['dataset']}: {report['examples']} examples, "
                        f"{report['prompt_tokens_mean']:.0f} prompt tokens on average, median of {report['repeats']}")
    for column in ("tier", "method", "TTFT mean (s)", "speedup vs full", "limit (s)", "TTFT / limit",
                   "predicted (s)", "prediction error", "first-token KL", "recompute share", "stored layers held"):
        table.add_column(column, justify="right")
    for tier in tiers:
        full = statistics.mean(cells[tier, "full"].ttft)
        for method in methods:
            c = cells[tier, method]
            ttft, limit = statistics.mean(c.ttft), statistics.mean(c.limit)
            label = method if method == c.chosen[-1] else f"{method} ({_tally(c.chosen)})"
            table.add_row(report_name(tier), label, f"{ttft:.3f}", f"{full / ttft:.2f}x", f"{limit:.3f}",
                          f"{ttft / limit:.2f}", f"{statistics.mean(c.predicted):.3f}",
                          f"{statistics.median(prediction_errors(c)):.0%}",
                          f"{statistics.mean(c.kl):.3f}", f"{statistics.mean(c.recompute_share):.3f}",
                          str(c.peak_layers_held))
    Console(width=220).print(table)  # an emulated tier's name (its device model) takes 20 more
    print("limit = max(read time of the bytes the method loads, full's TTFT x rows computed per layer / prompt rows);"
          " 'stored layers held' is the executor's measured peak of stored layers alive at once; prediction error:"
          " median over examples of |predicted - measured| / measured (kvreuse profile costs gives the profile).")
    for tier in tiers:
        for method in methods:
            cell = cells[tier, method]
            if method != "full" and (warning := under_its_limit(f"{method} on {report_name(tier)}",
                                                                statistics.mean(cell.ttft),
                                                                statistics.mean(cell.limit))):
                print(warning)
    errors = [e for c in cells.values() for e in prediction_errors(c)]
    if len(errors) > 1:
        print(f"cost model over every (example, tier, method): median error {statistics.median(errors):.1%}, "
              f"p90 {np.percentile(errors, 90):.1%}")


def print_auto_against_fixed(methods: list[str], tiers: list[str], cells: dict[tuple[str, str], Cell],
                             table: FidelityTable | None) -> None:
    """Per tier: auto's mean TTFT against the fastest fixed method the fidelity table says meets auto's floor,
    and against the fastest fixed method of all (whatever its fidelity)."""
    for auto in [m for m in methods if isinstance(parse_method(m), Auto)]:
        floor = parse_method(auto)
        fixed = [m for m in methods if not isinstance(parse_method(m), Auto)]
        admitted = [m for m in fixed if (f := expected_fidelity(table, m)) is not None and meets(f, floor)]
        for tier in tiers:
            ttft = {m: statistics.mean(cells[tier, m].ttft) for m in fixed + [auto]}
            best = min(admitted, key=ttft.__getitem__)  # full is always there, and exact
            fastest = min(fixed, key=ttft.__getitem__)
            print(f"{report_name(tier)}: {auto} {ttft[auto]:.3f} s = {ttft[auto] / ttft[best]:.2f}x the best fixed "
                  f"method meeting its floor ({best}, {ttft[best]:.3f} s); fastest fixed: {fastest} "
                  f"{ttft[fastest]:.3f} s")


def prediction_errors(cell: Cell) -> list[float]:
    return [abs(p - t) / t for p, t in zip(cell.predicted, cell.ttft)]


def _tally(chosen: list[str]) -> str:
    return ", ".join(f"{m} x{n}" for m, n in sorted(Counter(chosen).items()))
