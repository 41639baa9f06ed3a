"""TTFT of every chunk-reuse method, per store tier, side by side in one run, with speedup over `full`, the
first-token KL from `full`, and the limit each method could reach (DESIGN.md, "Speed").

    kvreuse bench fusion --dataset ../shared/datasets/hotpotqa.jsonl --limit 10

For each example, its chunks are compiled into every tier first (not timed, as in the papers); then each repeat
runs every (tier, method) pair in turn, so load from elsewhere on the machine falls on all of them alike.
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.tiers import tier_spec
from kvreuse.bench.timing import interleaved_samples, limit_seconds, read_all_seconds, prefill_variant
from kvreuse.engine.reuse import ReuseEngine
from kvreuse.eval.datasets import load_dataset
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.segments import Request
from kvreuse.model.loader import load_model
from kvreuse.store.spec import open_store

DEFAULT_METHODS = "full,naive,prefix,cacheblend:0.15,legolink:16,legolink0,cachetune:0.15"


@dataclass
class Cell:
    """One (tier, method): per-example median TTFT and what the runs reported."""

    ttft: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    limit: list[float] = field(default_factory=list)
    recompute_share: list[float] = field(default_factory=list)
    peak_layers_held: int = 0


def run(dataset: str, limit: int, methods: list[str], tiers: list[str], repeats: int, model: str | None) -> dict:
    loaded = load_model(model, "float32")
    prompts = load_dataset(dataset, limit=limit).prompts
    cells: dict[tuple[str, str], Cell] = defaultdict(Cell)
    lengths = []
    with tempfile.TemporaryDirectory(prefix="kvreuse-bench-") as scratch:
        specs = {tier: tier_spec(tier, scratch) for tier in tiers}
        engines = {
            tier: ReuseEngine(loaded, open_store(spec, model_fingerprint=loaded.fingerprint, dtype="float32"))
            for tier, spec in specs.items()
        }
        for prompt in prompts:
            request = next(iter(engines.values())).build_request(prompt.chunks, prompt.question)
            lengths.append(len(request))
            for engine in engines.values():
                engine.compile(request, methods)
            _run_example(engines, request, methods, repeats, cells)
        for engine in engines.values():
            engine.close()
    report = {"dataset": dataset, "examples": len(prompts), "prompt_tokens_mean": statistics.mean(lengths),
              "repeats": repeats, "specs": specs, "cells": {f"{t}|{m}": c.__dict__ for (t, m), c in cells.items()}}
    _print(report, methods, tiers, cells)
    return report


def _run_example(engines: dict[str, ReuseEngine], request: Request, methods: list[str], repeats: int,
                 cells: dict[tuple[str, str], Cell]) -> None:
    variants = {(tier, method): prefill_variant(engine, request, method)
                for tier, engine in engines.items() for method in methods}
    samples = interleaved_samples(variants, repeats)
    for tier, engine in engines.items():
        full = samples[tier, "full"].last
        full_ttft = samples[tier, "full"].median
        read_all = read_all_seconds(engine, request)
        for method in methods:
            out, cell = samples[tier, method].last, cells[tier, method]
            cell.ttft.append(samples[tier, method].median)
            cell.kl.append(first_token_kl(full.logits, out.logits))
            cell.recompute_share.append(out.stats["recompute_share"])
            cell.peak_layers_held = max(cell.peak_layers_held, out.stats["peak_stored_layers_held"])
            cell.limit.append(limit_seconds(out.stats, read_all, full_ttft, len(request)))


def _print(report: dict, methods: list[str], tiers: list[str], cells: dict[tuple[str, str], Cell]) -> None:
    table = Table(title=f"Chunk reuse TTFT, {report['dataset']}: {report['examples']} examples, "
                        f"{report['prompt_tokens_mean']:.0f} prompt tokens on average, median of {report['repeats']}")
    for column in ("tier", "method", "TTFT mean (s)", "speedup vs full", "limit (s)", "TTFT / limit",
                   "first-token KL", "recompute share", "stored layers held"):
        table.add_column(column, justify="right")
    for tier in tiers:
        full = statistics.mean(cells[tier, "full"].ttft)
        for method in methods:
            c = cells[tier, method]
            ttft, limit = statistics.mean(c.ttft), statistics.mean(c.limit)
            table.add_row(tier, method, f"{ttft:.3f}", f"{full / ttft:.2f}x", f"{limit:.3f}", f"{ttft / limit:.2f}",
                          f"{statistics.mean(c.kl):.3f}", f"{statistics.mean(c.recompute_share):.3f}",
                          str(c.peak_layers_held))
    Console(width=160).print(table)
    print("limit = max(read time of the bytes the method loads, full's TTFT x rows computed per layer / prompt rows);"
          " 'stored layers held' is the executor's measured peak of stored layers alive at once.")


def add_arguments(parser) -> None:
    parser.add_argument("--dataset", required=True, help="JSONL file in the schemas of ../shared/datasets/README.md")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--tiers", default="memory,disk", help="memory, disk, or store specs, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)


def main(args) -> int:
    methods = args.methods.split(",")
    for method in methods:
        parse_method(method)  # a bad name fails here, before the model loads
    if "full" not in methods:
        methods.insert(0, "full")
    with torch.inference_mode():
        run(args.dataset, args.limit, methods, args.tiers.split(","), args.repeats, args.model)
    return 0

