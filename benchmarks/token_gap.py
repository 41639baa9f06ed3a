"""What a long prompt does to the streams already running: the server's scheduler with `--max-token-gap-ms`
values side by side, in one process on the engine the server runs (embedded SmolLM2, fp32, method `full`).

A stream decodes (a long story, no end); once it has streamed `--warmup-tokens`, a prompt of HotpotQA passages
arrives. Reported per gap: the prompt's TTFT, and the running stream's longest wait for a token while that prompt
was computed. The gaps alternate on the same prompts, so a slow spell of the machine touches both.

    .venv/bin/python -m benchmarks.token_gap --prompts 4 --gaps none 250
"""

from __future__ import annotations

import argparse
import queue
import statistics
import subprocess
import time
from dataclasses import dataclass

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.engine.sampling import SamplingParams
from kvreuse.engine.scheduler import GenerationJob, JobEvent, Scheduler
from kvreuse.eval.datasets import load_dataset

DATASET = "../shared/datasets/hotpotqa.jsonl"
STORY = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class Arrival:
    prompt_tokens: int
    ttft: float  # seconds from the prompt's submission to its first token
    longest_gap: float  # the running stream's longest wait for a token meanwhile


def gap_seconds(text: str) -> float | None:
    return None if text == "none" else float(text) / 1e3


def arrive(engine: ReuseEngine, prompt, gap: float | None, warmup_tokens: int) -> Arrival:
    """One prompt arriving beside a decoding stream, under a scheduler with this max_token_gap."""
    token_times: list[float] = []  # the stream's decoding steps: a token each
    scheduler = Scheduler(engine, max_running=2, max_waiting=2, max_token_gap=gap,
                          on_decode_step=lambda _: token_times.append(time.perf_counter()))
    ended: queue.Queue[JobEvent] = queue.Queue()
    story = engine.build_request([], STORY)
    stream = GenerationJob(story, SamplingParams(max_tokens=engine.model.config.max_position_embeddings
                                                 - len(story), ignore_eos=True),
                           lambda e: ended.put(e) if e.result or e.error else None, method="full")
    first_token: queue.Queue[float] = queue.Queue()
    request = engine.build_request(prompt.chunks, prompt.question)
    arriving = GenerationJob(request, SamplingParams(max_tokens=1), lambda e: first_token.put(time.perf_counter()),
                             method="full")
    scheduler.start()
    try:
        scheduler.submit(stream)
        while len(token_times) < warmup_tokens:
            if not ended.empty():
                raise RuntimeError(f"the running stream ended early: {ended.get().error}")
            time.sleep(0.005)
        submitted = time.perf_counter()
        scheduler.submit(arriving)
        answered = first_token.get(timeout=600)
        while token_times[-1] < answered:  # the stream's first token after the prompt's
            time.sleep(0.005)
        stream.cancel()
        ended.get(timeout=60)
    finally:
        scheduler.stop()
    steps = list(token_times)
    waits = [b - a for a, b in zip(steps, steps[1:]) if b > submitted and a < answered]
    return Arrival(len(request), answered - submitted, max(waits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="HotpotQA rows, each a prompt of its passages")
    parser.add_argument("--gaps", nargs="+", default=["none", "250"],
                        help="max_token_gap values in ms, or none (prompts computed whole)")
    parser.add_argument("--warmup-tokens", type=int, default=20, help="tokens streamed before the prompt arrives")
    args = parser.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("CPU:", next((line.split(":", 1)[1].strip() for line in flags.splitlines() if "Model name" in line), "?"),
          "| avx512_bf16" if "avx512_bf16" in flags else "| no avx512_bf16")
    engine = ReuseEngine.load(store="memory:1GB")
    try:
        prompts = load_dataset(DATASET, limit=args.prompts).prompts
        runs: dict[str, list[Arrival]] = {gap: [] for gap in args.gaps}
        print("| prompt tokens | " + " | ".join(f"gap {g}: TTFT (ms) | longest wait (ms)" for g in args.gaps) + " |")
        print("|---:|" + "---:|---:|" * len(args.gaps))
        for prompt in prompts:
            row = [(gap, arrive(engine, prompt, gap_seconds(gap), args.warmup_tokens)) for gap in args.gaps]
            for gap, arrival in row:
                runs[gap].append(arrival)
            print(f"| {row[0][1].prompt_tokens} | "
                  + " | ".join(f"{a.ttft * 1e3:.0f} | {a.longest_gap * 1e3:.0f}" for _, a in row) + " |", flush=True)
        first = args.gaps[0]
        for gap in args.gaps[1:]:
            ratio = statistics.fmean(b.ttft / a.ttft for a, b in zip(runs[first], runs[gap]))
            print(f"gap {gap} against {first}: TTFT {ratio:.3f}x (mean of the prompts' ratios); longest wait "
                  f"{max(a.longest_gap for a in runs[gap]) * 1e3:.0f} ms against "
                  f"{max(a.longest_gap for a in runs[first]) * 1e3:.0f}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
