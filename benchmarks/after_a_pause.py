"""What a request pays for the time since the last one: a reuse method's prefill timed right after the one before
it, and after the process spent a while on nothing, on a spin, or on other work, in one process on one prompt.

`kvreuse bench ttft` times its variants in turns, so every request follows another variant's (and, with
`--peers vllm`, seconds of vLLM's in another process). On the VM of docs/RESULTS.md ("What a request pays for the
time since the last one") a request then took longer than right after itself, and the methods that compute least
lost the most against their limit. The conditions here tell apart what that could be: an idle CPU (asleep), a
cold cache (a sweep of other memory just before), or time itself (spinning, or busy on other memory, as long).
Each method's time is also given over its limit as `kvreuse bench ttft` prices it, from full prefill timed in
the same condition. A probe also times the first touch of each page of memory left alone for a while (numpy, no
torch).

    .venv/bin/python -m benchmarks.after_a_pause --methods naive legolink:16 cacheblend:0.15 --pause 1.7
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.fusion.segments import Request
from kvreuse.model.huge_pages import exec_with_huge_page_heap

DATASET = "../shared/datasets/hotpotqa.jsonl"
SWEEP_BYTES = 640 * 2**20  # more than the model's fp32 weights: a pass over it leaves little of them cached


def conditions(pause: float, other: torch.Tensor) -> dict[str, Callable[[], None]]:
    """What the process does between two requests, by name; the sweep passes over `other` (memory of its own)."""
    small = torch.ones(2**21)  # 8 MB: the other work's data stays in the caches

    def for_the_pause(work: Callable[[], object]) -> Callable[[], None]:
        def spend() -> None:
            start = time.perf_counter()
            while time.perf_counter() - start < pause:
                work()
        return spend

    return {
        "back to back": lambda: None,
        "after a sweep of other memory": lambda: other.add_(1.0),
        f"after {pause:g} s asleep": lambda: time.sleep(pause),
        f"after {pause:g} s spinning one thread": for_the_pause(lambda: None),
        f"after {pause:g} s of other work on every thread": for_the_pause(lambda: small.add_(1.0)),
    }


def time_after(engine: ReuseEngine, request: Request, methods: list[str], spend: dict[str, Callable[[], None]],
               rounds: int, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    """Seconds of each method's prefill after each way of spending the time before it, `rounds` times in a
    shuffled order (a seeded shuffle: no condition always follows the same one)."""
    seconds = {m: {name: [] for name in spend} for m in methods}
    turns = [(m, name) for m in methods for name in spend]
    shuffle = random.Random(seed).shuffle
    for method in methods:
        engine.prefill(request, method)  # warm-up
    for _ in range(rounds):
        shuffle(turns)
        for method, name in turns:
            spend[name]()
            start = time.perf_counter()
            engine.prefill(request, method)
            seconds[method][name].append(time.perf_counter() - start)
    return seconds


def first_touch_ns(pauses: list[float], megabytes: int = 64, repeats: int = 4) -> dict[float, float]:
    """Median nanoseconds to read one value of each 4 KB page of `megabytes` of memory, after the pause spent
    spinning on other memory, by pause."""
    pages, other = np.ones(megabytes * 2**20 // 8), np.ones(4 * 2**20 // 8)
    step = 4096 // 8
    result = {}
    for pause in pauses:
        times = []
        for _ in range(repeats):
            pages[::step].sum()
            start = time.perf_counter()
            while time.perf_counter() - start < pause:
                other[::8].sum()
            start = time.perf_counter()
            pages[::step].sum()
            times.append((time.perf_counter() - start) / (pages.size // step) * 1e9)
        result[pause] = statistics.median(times)
    return result


def main() -> None:
    exec_with_huge_page_heap()  # the heap the kvreuse command runs with
    from kvreuse.bench.prefill import load_model
    from kvreuse.bench.tiers import open_engines
    from kvreuse.bench.workload import Shape, TextSource, build_workload

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["naive", "legolink:16", "cacheblend:0.15"])
    parser.add_argument("--pause", type=float, default=1.7, help="seconds (vLLM's 1.6K prefill here: ~1.7)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--length", type=int, default=1600)
    parser.add_argument("--dataset", default=DATASET)
    args = parser.parse_args()
    loaded = load_model(None, "float32")
    workload = build_workload(loaded.tokenizer, TextSource(args.dataset), Shape(args.length, 10), 0,
                              loaded.runtime.config.max_position_embeddings)
    methods = ["full", *[m for m in args.methods if m != "full"]]
    with contextlib.ExitStack() as stack, torch.inference_mode():
        engines, _ = open_engines(loaded, ["memory"], stack, "float32", None)
        engine = engines["memory"]
        engine.compile(workload.request, methods)
        spend = conditions(args.pause, torch.ones(SWEEP_BYTES // 4))
        seconds = time_after(engine, workload.request, methods, spend, args.rounds)
        rows = {m: engine.prefill(workload.request, m).stats.fusion.computed_rows_mean for m in methods}
    print(f"prompt of {len(workload.request)} tokens from {args.dataset}, memory tier, fp32, {args.rounds} rounds; "
          "median ms (x back to back, x limit: full's median in the same condition x rows computed / prompt rows)")
    full = {name: statistics.median(s) for name, s in seconds["full"].items()}
    for method, by_condition in seconds.items():
        base = statistics.median(by_condition["back to back"])
        cells = []
        for name, s in by_condition.items():
            limit = full[name] * rows[method] / len(workload.request)
            cells.append(f"{name} {statistics.median(s) * 1e3:.1f} ({statistics.median(s) / base:.2f}, "
                         f"{statistics.median(s) / limit:.2f})")
        print(f"{method}: " + "; ".join(cells))
    pauses = [0.0, 0.3, 1.0, args.pause, 2 * args.pause]
    touches = first_touch_ns(pauses)
    print("first touch of a 4 KB page of 64 MB left alone (ns), by seconds since: "
          + ", ".join(f"{p:g} s {ns:.0f}" for p, ns in touches.items()))


if __name__ == "__main__":
    main()
