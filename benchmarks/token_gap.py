"""What long prompts do to the streams already running: the server's scheduler with `--max-token-gap-ms`
values side by side, in one process on the engine the server runs (embedded SmolLM2, fp32, method `full`).

A stream decodes (a long story, no end); once it has streamed `--warmup-tokens`, prompts of HotpotQA passages
arrive, `--batch` of them at once (admitted together, as the server admits up to `--max-prefill-batch`).
Reported per gap: the prompts' TTFT, and the running stream's longest wait for a token while they were computed.
The gaps alternate on the same prompts, so a slow spell of the machine touches both.

    .venv/bin/python -m benchmarks.token_gap --prompts 4 --gaps none 250
    .venv/bin/python -m benchmarks.token_gap --prompts 8 --batch 4 --gaps none 250
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
    prompt_tokens: list[int]
    ttfts: list[float]  # seconds from the prompts' submission to each one's first token
    longest_gap: float  # the running stream's longest wait for a token meanwhile

    @property
    def ttft(self) -> float:
        return statistics.fmean(self.ttfts)


def gap_seconds(text: str) -> float | None:
    return None if text == "none" else float(text) / 1e3


def arrive(engine: ReuseEngine, prompts: list, gap: float | None, warmup_tokens: int) -> Arrival:
    """Prompts arriving together beside a decoding stream, under a scheduler with this max_token_gap."""
    token_times: list[float] = []  # the stream's decoding steps: a token each
    scheduler = Scheduler(engine, max_running=1 + len(prompts), max_waiting=len(prompts),
                          max_prefill_batch=len(prompts), max_token_gap=gap,
                          on_decode_step=lambda _: token_times.append(time.perf_counter()))
    ended: queue.Queue[JobEvent] = queue.Queue()
    story = engine.build_request([], STORY)
    stream = GenerationJob(story, SamplingParams(max_tokens=engine.model.config.max_position_embeddings
                                                 - len(story), ignore_eos=True),
                           lambda e: ended.put(e) if e.result or e.error else None, method="full")
    first_tokens: dict[int, float] = {}
    requests = [engine.build_request(prompt.chunks, prompt.question) for prompt in prompts]
    arriving = [GenerationJob(request, SamplingParams(max_tokens=1),
                              lambda e, i=i: first_tokens.setdefault(i, time.perf_counter()), method="full")
                for i, request in enumerate(requests)]
    scheduler.start()
    try:
        scheduler.submit(stream)
        while len(token_times) < warmup_tokens:
            if not ended.empty():
                raise RuntimeError(f"the running stream ended early: {ended.get().error}")
            time.sleep(0.005)
        with scheduler.held():  # the prompts are admitted together
            for job in arriving:
                scheduler.submit(job)
            submitted = time.perf_counter()
        while len(first_tokens) < len(arriving):
            if time.perf_counter() - submitted > 600:
                raise TimeoutError("the prompts' first tokens took over 10 minutes")
            time.sleep(0.005)
        answered = max(first_tokens.values())
        while token_times[-1] < answered:  # the stream's first token after the last prompt's
            time.sleep(0.005)
        stream.cancel()
        ended.get(timeout=60)
    finally:
        scheduler.stop()
    steps = list(token_times)
    waits = [b - a for a, b in zip(steps, steps[1:]) if b > submitted and a < answered]
    return Arrival([len(r) for r in requests], [first_tokens[i] - submitted for i in range(len(arriving))],
                   max(waits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="HotpotQA rows, each a prompt of its passages")
    parser.add_argument("--batch", type=int, default=1, help="prompts arriving at once (admitted together)")
    parser.add_argument("--gaps", nargs="+", default=["none", "250"],
                        help="max_token_gap values in ms, or none (prompts computed whole)")
    parser.add_argument("--warmup-tokens", type=int, default=20, help="tokens streamed before the prompt arrives")
    args = parser.parse_args()
    if not 1 <= args.batch <= args.prompts:
        parser.error(f"--batch must be between 1 and --prompts ({args.prompts}), got {args.batch}")
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print("CPU:", next((line.split(":", 1)[1].strip() for line in flags.splitlines() if "Model name" in line), "?"),
          "| avx512_bf16" if "avx512_bf16" in flags else "| no avx512_bf16")
    engine = ReuseEngine.load(store="memory:1GB")
    try:
        prompts = load_dataset(DATASET, limit=args.prompts).prompts
        batches = [prompts[i:i + args.batch] for i in range(0, len(prompts) - args.batch + 1, args.batch)]
        runs: dict[str, list[Arrival]] = {gap: [] for gap in args.gaps}
        print("| prompt tokens | "
              + " | ".join(f"gap {g}: TTFT (ms, mean) | longest wait (ms)" for g in args.gaps) + " |")
        print("|---:|" + "---:|---:|" * len(args.gaps))
        for batch in batches:
            row = [(gap, arrive(engine, batch, gap_seconds(gap), args.warmup_tokens)) for gap in args.gaps]
            for gap, arrival in row:
                runs[gap].append(arrival)
            print(f"| {' + '.join(map(str, row[0][1].prompt_tokens))} | "
                  + " | ".join(f"{a.ttft * 1e3:.0f} | {a.longest_gap * 1e3:.0f}" for _, a in row) + " |", flush=True)
        first = args.gaps[0]
        for gap in args.gaps[1:]:
            ratio = statistics.fmean(b.ttft / a.ttft for a, b in zip(runs[first], runs[gap]))
            print(f"gap {gap} against {first}: TTFT {ratio:.3f}x (mean of the arrivals' ratios); longest wait "
                  f"{max(a.longest_gap for a in runs[gap]) * 1e3:.0f} ms against "
                  f"{max(a.longest_gap for a in runs[first]) * 1e3:.0f}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
