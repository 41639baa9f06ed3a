"""Prefix restoration benchmark: TTFT of load-only, compute-only, Cake (token-wise), layer-wise and CacheFlow
(whichever of the two the profiled L_delta picks) per tier and prefix length, against the ideal split computed
from the same run's per-block times; then a batch of requests with mixed prefix lengths, batch-aware scheduler
against per-request Cake. Also `kvreuse profile l-delta`: measure L_delta on this machine and save it.

Variants take turns within every repeat (and the order rotates), so load from other work on the machine falls
on all of them alike; figures are medians over repeats.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.tiers import emulated_device, report_name, tier_spec
from kvreuse.model.loader import load_model
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import PrefixRestorer, l_delta
from kvreuse.restore.batch import BatchRestorer
from kvreuse.store import KeySpace, open_store
from kvreuse.store.tiered import TieredStore

FRESH_TOKENS = 32  # the new turn after the stored prefix: always computed
# Prefixes shorter than this get proportionally more repeats: their restorations take a few ms beside a fresh
# turn of tens of ms whose spread alone is of the targets' size, and repeating them is cheap.
REPEAT_SCALE_TOKENS = 2048


def repeats_for(length: int, repeats: int) -> int:
    """Repeats of a prefix length: `repeats`, times 2048 / length below 2048 tokens."""
    return repeats * max(1, REPEAT_SCALE_TOKENS // length)


@dataclass
class BenchModel:
    model: LayerwiseModel
    space: KeySpace
    name: str
    whole: bool  # all the model's layers: what an engine of this model runs, and whose profiles it reads


def bench_model(layers: int | None) -> BenchModel:
    """The embedded SmolLM2-135M (real weights), optionally cut to its first `layers` layers: per-layer compute
    and KV size stay the real model's, the run gets shorter."""
    loaded = load_model(None, "float32")
    hf_model = loaded.runtime.hf_model
    name, fingerprint = loaded.name, loaded.fingerprint
    whole = layers is None or layers >= len(hf_model.model.layers)
    if not whole:
        hf_model.model.layers = hf_model.model.layers[:layers]
        hf_model.config.num_hidden_layers = layers
        name, fingerprint = f"{name} (first {layers} layers)", f"{fingerprint}-layers{layers}"
    return BenchModel(LayerwiseModel(hf_model), KeySpace(fingerprint, loaded.tokenizer_fingerprint), name, whole)


def open_tiers(names: list[str], tmp: str) -> dict[str, TieredStore]:
    return {name: open_store(tier_spec(name, tmp)) for name in names}


def stored_prompt(bench: BenchModel, stores: dict[str, TieredStore], prefix: int, seed: int, block: int
                  ) -> list[int]:
    """A prompt of `prefix` stored tokens and a fresh turn; the prefix is computed once and put in every tier."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, bench.model.config.vocab_size, (prefix + FRESH_TOKENS,), generator=generator).tolist()
    source = PrefixRestorer(bench.model, open_store("memory:8GB"), bench.space, block)
    source.store_prefix(ids[:prefix])
    for store in stores.values():
        for key in source.block_keys(ids[:prefix]):
            store.put(source.store.get(key))
        store.flush()
    source.store.close()
    return ids


def warm_up(restorer: PrefixRestorer, ids: list[int]) -> None:
    """Unmeasured runs of both two-pointer strategies: they also give the restorer the compute and load rates
    its first claims are sized by, as a serving engine's earlier requests would."""
    for strategy in ("cake", "layerwise"):
        restorer.restore(ids, strategy)


def ideal_seconds(compute_spans: list, load_spans: list, remainder: float) -> float:
    """min over split points x of max(compute of positions < x, load of positions >= x), plus the remainder.
    Spans are [start, stop, seconds] of the same axis; a span's time is spread evenly over its positions, so
    both sides are piecewise linear in x and the minimum lies at an edge or where the two cross."""

    def before(spans: list, x: float) -> float:
        return sum(t * min(1.0, max(0.0, (x - a) / (b - a))) for a, b, t in spans)

    total_load = sum(t for _, _, t in load_spans)
    edges = sorted({e for a, b, _ in compute_spans + load_spans for e in (a, b)})

    def gap(x: float) -> float:  # compute before x minus load after x: rises with x
        return before(compute_spans, x) - (total_load - before(load_spans, x))

    candidates = list(edges)
    for a, b in zip(edges, edges[1:]):
        if gap(a) < 0 < gap(b):
            candidates.append(a + (b - a) * -gap(a) / (gap(b) - gap(a)))
    return min(max(before(compute_spans, x), total_load - before(load_spans, x)) for x in candidates) + remainder


def _median(runs: list[dict], key: str = "total_seconds") -> float:
    return statistics.median(r[key] for r in runs)


def cacheflow_choice(space: KeySpace, tier: str, prefix: int) -> str:
    threshold = l_delta.threshold(space.model_fingerprint, tier)
    return "layerwise" if threshold is not None and prefix < threshold else "cake"


def bench_lengths(bench: BenchModel, tiers: list[str], lengths: list[int], repeats: int, block: int,
                  compute_run: int, tmp: str) -> list[dict]:
    stores = open_tiers(tiers, tmp)
    restorers = {t: PrefixRestorer(bench.model, s, bench.space, block, compute_run=compute_run)
                 for t, s in stores.items()}
    rows = []
    try:
        for length in lengths:
            ids = stored_prompt(bench, stores, length, seed=length, block=block)
            runs: dict[tuple[str, str], list[dict]] = {}
            variants = [("*", "compute")] + [(t, s) for t in tiers for s in ("load", "cake", "layerwise")]
            for restorer in restorers.values():
                warm_up(restorer, ids)
            for r in range(repeats_for(length, repeats)):
                for tier, strategy in variants[r % len(variants):] + variants[: r % len(variants)]:
                    restorer = restorers[tiers[0] if tier == "*" else tier]
                    runs.setdefault((tier, strategy), []).append(restorer.restore(ids, strategy).stats)
            rows += [_length_row(bench, length, tier, runs) for tier in tiers]
            print(f"  {length} tokens done", flush=True)
    finally:
        for store in stores.values():
            store.close()
    return rows


def _length_row(bench: BenchModel, length: int, tier: str, runs: dict) -> dict:
    compute, load = runs[("*", "compute")], runs[(tier, "load")]
    ideals = [ideal_seconds(c["compute_spans"], ld["load_spans"], c["total_seconds"] - c["restore_seconds"])
              for c, ld in zip(compute, load)]
    choice = cacheflow_choice(bench.space, tier, length)
    ttft = {name: [r["total_seconds"] for r in variant_runs] for name, variant_runs in
            (("load", load), ("compute", compute), ("cake", runs[(tier, "cake")]),
             ("layerwise", runs[(tier, "layerwise")]))}
    ttft["cacheflow"] = ttft[choice]
    best = [min(a, b) for a, b in zip(ttft["load"], ttft["compute"])]
    row = {"tier": tier, "emulated": emulated_device(tier), "prefix": length, "repeats": len(compute),
           "ideal": statistics.median(ideals),
           **{name: statistics.median(times) for name, times in ttft.items()}, "cacheflow_strategy": choice,
           "cake_tokens_computed": statistics.median(r["tokens_computed"] for r in runs[(tier, "cake")]),
           "layerwise_tokens_computed": statistics.median(r["tokens_computed"] for r in runs[(tier, "layerwise")])}
    row["paired"] = {f"{name}/{base}": _paired(ttft[name], reference)
                     for name in ("cake", "cacheflow") for base, reference in (("ideal", ideals), ("best", best))}
    row["paired"]["cake/load"] = _paired(ttft["cake"], ttft["load"])
    return row


def _paired(numerator: list[float], denominator: list[float]) -> float:
    """Median over repeats of each repeat's own ratio. A repeat's variants run back to back, so a slow spell of
    the machine falls on both sides of its ratio, where a ratio of medians can set a fast spell against a slow
    one: where Cake computes nothing it runs load-only's code, and the two estimators' distance from 1 there is
    the benchmark's own error."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def bench_batch(bench: BenchModel, tier: str, lengths: list[int], repeats: int, block: int, compute_run: int,
                tmp: str, compute_workers: list[int], io_priorities: list[str]) -> dict:
    """Mean and p90 restoration time (admission to first-token logits) of a batch admitted at once: per-request
    Cake, and the batch-aware scheduler with each I/O priority and each number of compute workers."""
    stores = open_tiers([tier], tmp)
    prompts = [stored_prompt(bench, stores, n, seed=1000 + n, block=block) for n in lengths]

    def warm_restorer() -> PrefixRestorer:
        """A restorer of its own per variant: the rates it sizes claims by are learnt from that variant's own
        runs, as in a deployment running only it (a batched step's rates are not a lone restoration's)."""
        restorer = PrefixRestorer(bench.model, stores[tier], bench.space, block, compute_run=compute_run)
        for prompt in prompts:
            warm_up(restorer, prompt)
        return restorer

    def per_request(restorer: PrefixRestorer) -> list[float]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: restorer.restore(p, "cake"), prompts))
        return [r.stats["total_seconds"] for r in results]

    def batch_aware(restorer: PrefixRestorer, io_priority: str, workers: int) -> list[float]:
        batch = BatchRestorer(restorer, workers, io_priority)
        try:
            futures = [batch.submit(p, "cake") for p in prompts]
            return [f.result().stats["total_seconds"] for f in futures]
        finally:
            batch.close()

    variants = [("per-request cake", partial(per_request, warm_restorer()))] + [
        (f"batch-aware {p}, {w} worker{'s' if w > 1 else ''}", partial(batch_aware, warm_restorer(), p, w))
        for w in compute_workers for p in io_priorities]
    times: dict[str, list[list[float]]] = {name: [] for name, _ in variants}
    try:
        for r in range(repeats):
            for name, variant in variants[r % len(variants):] + variants[: r % len(variants)]:
                times[name].append(variant())
    finally:
        stores[tier].close()
    means = {name: [float(np.mean(t)) for t in ts] for name, ts in times.items()}
    p90s = {name: [float(np.percentile(t, 90)) for t in ts] for name, ts in times.items()}
    base = "per-request cake"
    summary = {name: {"mean": statistics.median(means[name]), "p90": statistics.median(p90s[name]),
                      "per_request": [statistics.median(t[i] for t in ts) for i in range(len(lengths))],
                      "paired_speedup": {"mean": _paired(means[base], means[name]),
                                         "p90": _paired(p90s[base], p90s[name])}}
               for name, ts in times.items()}
    return {"tier": tier, "emulated": emulated_device(tier), "lengths": lengths, "compute_workers": compute_workers,
            "repeats": repeats, "variants": summary}


def measure_l_delta(bench: BenchModel, tier: str, lengths: list[int], repeats: int, block: int, compute_run: int,
                    tmp: str) -> tuple[int, dict, dict]:
    """Token-wise and layer-wise TTFT medians per prefix length on `tier`; saves and returns L_delta."""
    stores = open_tiers([tier], tmp)
    restorer = PrefixRestorer(bench.model, stores[tier], bench.space, block, compute_run=compute_run)
    token, layer = {}, {}
    try:
        for length in lengths:
            ids = stored_prompt(bench, stores, length, seed=length, block=block)
            warm_up(restorer, ids)
            runs: dict[str, list[dict]] = {"cake": [], "layerwise": []}
            for strategy in itertools.islice(itertools.cycle(runs), 2 * repeats_for(length, repeats)):
                runs[strategy].append(restorer.restore(ids, strategy).stats)
            token[length], layer[length] = _median(runs["cake"]), _median(runs["layerwise"])
    finally:
        stores[tier].close()
    return l_delta.save(bench.space.model_fingerprint, tier, token, layer), token, layer


# ---- reports ----------------------------------------------------------------------------------------------


def print_lengths(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    columns = ["tier", "prefix", "ideal", "load-only", "compute-only", "cake", "layer-wise", "cacheflow",
               "cake / ideal", "cacheflow / ideal", "cake / best base", "cacheflow / best base", "cake / load-only",
               "cake tokens computed", "layer-wise tokens computed"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        best = min(row["load"], row["compute"])
        medians = {"cake/ideal": row["cake"] / row["ideal"], "cacheflow/ideal": row["cacheflow"] / row["ideal"],
                   "cake/best": row["cake"] / best, "cacheflow/best": row["cacheflow"] / best,
                   "cake/load": row["cake"] / row["load"]}
        table.add_row(
            report_name(row["tier"]), str(row["prefix"]),
            *(f"{row[k] * 1e3:.0f}" for k in ("ideal", "load", "compute", "cake", "layerwise")),
            f"{row['cacheflow'] * 1e3:.0f} ({row['cacheflow_strategy'][:5]})",
            *(f"{ratio:.2f} ({row['paired'][name]:.2f})" for name, ratio in medians.items()),
            f"{row['cake_tokens_computed']:g}", f"{row['layerwise_tokens_computed']:g}",
        )
    Console(width=200).print(table)
    print("times: TTFT in ms (restore the prefix, compute the fresh turn, first-token logits), medians. "
          "ideal = min over split points of max(compute of the prefix before it, load of the rest) + the fresh turn, "
          "from the same repeat's compute-only and load-only per-block times. best base = min(load-only, compute-only). "
          "ratios: of the medians (in brackets: the median of each repeat's own ratio, paired).")


def print_batch(result: dict) -> None:
    variants = result["variants"]
    base = variants["per-request cake"]
    print(f"batch of {len(result['lengths'])} (prefixes {result['lengths']}) on {report_name(result['tier'])}, "
          f"compute workers {result['compute_workers']}, median of {result['repeats']} batches:")
    for name, v in variants.items():
        each = ", ".join(f"{t * 1e3:.0f}" for t in v["per_request"])
        print(f"  {name:36s} mean {v['mean'] * 1e3:5.0f} ms, p90 {v['p90'] * 1e3:5.0f} ms "
              f"(per request {each}); speed-up over per-request Cake: mean {base['mean'] / v['mean']:.2f}x "
              f"(paired {v['paired_speedup']['mean']:.2f}x), p90 {base['p90'] / v['p90']:.2f}x "
              f"(paired {v['paired_speedup']['p90']:.2f}x)")


def run(layers: int | None, tiers: list[str], lengths: list[int], repeats: int, block: int, threads: int,
        compute_run: int, batch_tiers: list[str], batch_lengths: list[int], batch_compute_workers: list[int],
        batch_io: list[str], batch_repeats: int, json_out: Path | None) -> dict:
    torch.set_num_threads(threads)
    bench = bench_model(layers)
    _check_window(bench, [*lengths, *batch_lengths])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvreuse-restore-bench-", dir="/var/tmp") as tmp:
        rows = bench_lengths(bench, tiers, lengths, repeats, block, compute_run, tmp) if lengths else []
        batches = [bench_batch(bench, tier, batch_lengths, batch_repeats, block, compute_run, tmp,
                               batch_compute_workers, batch_io) for tier in batch_tiers]
    if rows:
        print_lengths(rows, f"Prefix restoration, {bench.name}, fp32, block {block}, compute run {compute_run}, "
                            f"{threads} torch thread(s), median of {repeats} x 2048 / prefix (at least {repeats})")
    for batch in batches:
        print_batch(batch)
    print(f"total bench time {time.perf_counter() - started:.0f} s")
    result = {"model": bench.name, "block": block, "compute_run": compute_run, "threads": threads,
              "repeats": repeats, "rows": rows, "batches": batches}
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _check_window(bench: BenchModel, lengths: list[int]) -> None:
    window = bench.model.config.max_position_embeddings
    if lengths and max(lengths) + FRESH_TOKENS > window:
        raise ValueError(f"lengths: a stored prefix of {max(lengths)} tokens and its {FRESH_TOKENS}-token turn exceed "
                         f"the model's context window of {window}")


def run_profile(layers: int | None, tiers: list[str], lengths: list[int], repeats: int, block: int,
                threads: int, compute_run: int) -> None:
    torch.set_num_threads(threads)
    bench = bench_model(layers)
    _check_window(bench, lengths)
    with tempfile.TemporaryDirectory(prefix="kvreuse-profile-", dir="/var/tmp") as tmp:
        for tier in tiers:
            threshold, token, layer = measure_l_delta(bench, tier, lengths, repeats, block, compute_run, tmp)
            cells = ", ".join(f"{n}: {token[n] * 1e3:.0f}/{layer[n] * 1e3:.0f}" for n in sorted(token))
            print(f"{bench.name} on {report_name(tier)}: L_delta = {threshold} tokens "
                  f"(token-wise/layer-wise ms by prefix length: {cells})")
    print(f"saved to {l_delta.profile_path()} under the fingerprint {bench.space.model_fingerprint}")
    if not bench.whole:
        print(f"a profile of the first {layers} layers: engines of the whole model do not read it (--layers 0 does)")
