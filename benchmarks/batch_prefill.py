"""Does restoring waiting requests' stored prefixes together pay on this machine? The server's two admission
policies side by side, through the engine the server runs: `--max-prefill-batch 1` (each request's prefix
restored alone, one request after another) against `--max-prefill-batch N` (CacheFlow's batch-aware
restoration: the N prefixes restored together, then each request's plan).

N conversations arrive at once, each with its own stored history (a system prompt of HotpotQA passages, of
different lengths) and a new question; method `prefix` (exact), embedded SmolLM2, fp32. A request's TTFT is
counted from the moment all N arrived to its first-token logits, as the server's queue sees it. Runs alternate
between the policies, after one warm-up of each.

    .venv/bin/python -m benchmarks.batch_prefill --tiers memory disk --lengths 512 1024 1536 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.eval.datasets import load_dataset

DATASET = "../shared/datasets/hotpotqa.jsonl"


def histories(engine: ReuseEngine, lengths: list[int]) -> list[str]:
    """System prompts of about `lengths` tokens each, from different passages."""
    passages = [chunk for prompt in load_dataset(DATASET, limit=40).prompts for chunk in prompt.chunks]
    prompts, at = [], 0
    for length in lengths:
        text = ""
        while len(engine.tokenizer.encode(text)) < length:
            text += passages[at % len(passages)] + "\n"
            at += 1
        prompts.append(engine.tokenizer.decode(engine.tokenizer.encode(text)[:length]))
    return prompts


def one_by_one(engine: ReuseEngine, requests) -> list[float]:
    start, ttft = time.perf_counter(), []
    for request in requests:
        engine.prefill(request, "prefix")
        ttft.append(time.perf_counter() - start)
    return ttft


def batched(engine: ReuseEngine, requests) -> list[float]:
    start, ttft = time.perf_counter(), []
    for fused in engine.prefill_batch([(r, "prefix", 0) for r in requests]):
        if isinstance(fused, Exception):
            raise fused
        ttft.append(time.perf_counter() - start)
    return ttft


def bench_tier(tier: str, lengths: list[int], repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store = "memory:8GB" if tier == "memory" else f"disk:{tmp}"
        engine = ReuseEngine.load(store=store, prefix_block_size=256)
        try:
            requests = [engine.build_request([], f"Question {i}: who is named first above?", system)
                        for i, system in enumerate(histories(engine, lengths))]
            for request in requests:
                engine.compile(request, ["prefix"])
            runs = {"alone": [], "batch": []}
            for repeat in range(repeats + 1):  # the first of each is a warm-up
                for name, policy in (("alone", one_by_one), ("batch", batched)):
                    ttft = policy(engine, requests)
                    if repeat:
                        runs[name].append(ttft)
            strategies = {engine.prefill(r, "prefix").stats.prefix.strategy for r in requests}
        finally:
            engine.close()
    return {"tier": tier, "strategies": sorted(strategies), **{
        name: {"mean_ttft": statistics.median(statistics.fmean(t) for t in ttfts),
               "last_ttft": statistics.median(t[-1] for t in ttfts)} for name, ttfts in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 1536, 2048],
                        help="history tokens of each waiting conversation (one per request)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("CPU:", next((line.split(":", 1)[1].strip() for line in flags.splitlines() if "Model name" in line), "?"),
          "| avx512_bf16" if "avx512_bf16" in flags else "| no avx512_bf16")
    print(f"{len(args.lengths)} requests arriving together, histories of {args.lengths} tokens, method prefix")
    print("| tier | strategies | mean TTFT alone (s) | mean TTFT batch (s) | batch / alone | last TTFT alone (s) "
          "| last TTFT batch (s) | batch / alone |")
    print("|---|---|---|---|---|---|---|---|")
    for tier in args.tiers:
        row = bench_tier(tier, args.lengths, args.repeats)
        alone, batch = row["alone"], row["batch"]
        print(f"| {tier} | {', '.join(row['strategies'])} | {alone['mean_ttft']:.2f} | {batch['mean_ttft']:.2f} | "
              f"{batch['mean_ttft'] / alone['mean_ttft']:.2f} | {alone['last_ttft']:.2f} | {batch['last_ttft']:.2f} "
              f"| {batch['last_ttft'] / alone['last_ttft']:.2f} |")


if __name__ == "__main__":
    main()
