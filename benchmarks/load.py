"""Load test of `kvreuse serve`: N concurrent streaming chat clients for a fixed time with a RAG mix.

Each request sends the passages of a HotpotQA row as `documents` and its question as the user message. Rows are
drawn from a small pool, so documents repeat across requests and the store's chunks get reused, as in a RAG
service whose corpus has hot documents. Reports request rate, client-side TTFT (arrival to the first streamed
token) p50/p90/p99, end-to-end latency, errors and the server's peak RSS.

    flock /work/bench.lock .venv/bin/python benchmarks/load.py --clients 32 --duration 60 --out runs/load.json

By default it starts `kvreuse serve` (embedded model) on a free loopback port and stops it at the end; --url
targets a running server instead (then no RSS is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import psutil

from kvreuse.eval.datasets import load_dataset


@dataclass
class Outcome:
    ttft: float | None = None  # seconds to the first streamed token
    latency: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class Report:
    clients: int
    duration_s: float
    requests: int
    errors: int
    requests_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    latency_p50_s: float
    output_tokens_per_s: float
    cached_prompt_share: float  # prompt tokens whose stored KV was reused, over all prompt tokens
    peak_rss_mb: float | None
    machine_load_1min: float  # the machine's load average at the end: other work shares the cores
    settings: dict = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class RssWatcher:
    """Samples the resident memory of a process and its children until stopped; keeps the peak."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.process, self.interval, self.peak = psutil.Process(pid), interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                rss = sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "kvreuse.cli", "serve", *([args.model] if args.model else []),
               "--port", str(port), "--store", args.store, "--max-concurrency", str(args.max_concurrency),
               "--served-model-name", "kvreuse", "--log-level", "warning"]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise SystemExit("the server did not start within 300 s")
        time.sleep(0.5)


async def one_request(client: openai.AsyncOpenAI, prompt, args: argparse.Namespace) -> Outcome:
    outcome, started = Outcome(), time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model="kvreuse", messages=[{"role": "user", "content": prompt.question}], max_tokens=args.max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"documents": prompt.chunks, "kvreuse": {"method": args.method}},
        )
        async for chunk in stream:
            if outcome.ttft is None and chunk.choices and chunk.choices[0].delta.content:
                outcome.ttft = time.perf_counter() - started
            if chunk.usage:
                outcome.completion_tokens = chunk.usage.completion_tokens
                outcome.prompt_tokens = chunk.usage.prompt_tokens
                outcome.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
        if not outcome.prompt_tokens:
            outcome.error = "the stream ended without usage"
    except (openai.OpenAIError, httpx.HTTPError) as e:
        outcome.error = f"{type(e).__name__}: {e}"
    outcome.latency = time.perf_counter() - started
    return outcome


async def client_loop(url: str, prompts: list, args: argparse.Namespace, seed: int, deadline: float,
                      outcomes: list[Outcome]) -> None:
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=args.request_timeout) as client:
        while time.perf_counter() < deadline:
            outcomes.append(await one_request(client, rng.choice(prompts), args))


async def run_clients(url: str, prompts: list, args: argparse.Namespace) -> tuple[list[Outcome], float]:
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    deadline = started + args.duration
    await asyncio.gather(*(client_loop(url, prompts, args, i, deadline, outcomes) for i in range(args.clients)))
    return outcomes, time.perf_counter() - started


def summarise(outcomes: list[Outcome], elapsed: float, peak_rss: float | None, args: argparse.Namespace) -> Report:
    done = [o for o in outcomes if o.error is None]
    ttfts = [o.ttft for o in done if o.ttft is not None]
    prompt_tokens = sum(o.prompt_tokens for o in done)
    return Report(
        clients=args.clients,
        duration_s=round(elapsed, 1),
        requests=len(done),
        errors=len(outcomes) - len(done),
        requests_per_s=len(done) / elapsed,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile([o.latency for o in done], 50),
        output_tokens_per_s=sum(o.completion_tokens for o in done) / elapsed,
        cached_prompt_share=sum(o.cached_tokens for o in done) / prompt_tokens if prompt_tokens else 0.0,
        peak_rss_mb=peak_rss,
        machine_load_1min=os.getloadavg()[0],
        settings={k: v for k, v in vars(args).items() if k != "out"},
        error_samples=[o.error for o in outcomes if o.error][:5],
    )


def print_report(report: Report) -> None:
    print(f"{report.clients} clients, {report.duration_s} s: {report.requests} requests "
          f"({report.requests_per_s:.2f}/s), {report.errors} errors")
    print(f"TTFT p50 {report.ttft_p50_s:.2f} s, p90 {report.ttft_p90_s:.2f} s, p99 {report.ttft_p99_s:.2f} s; "
          f"latency p50 {report.latency_p50_s:.2f} s; {report.output_tokens_per_s:.1f} output tokens/s")
    rss = f"{report.peak_rss_mb:.0f} MB" if report.peak_rss_mb is not None else "not measured (--url)"
    print(f"prompt tokens reused: {report.cached_prompt_share:.0%}; server peak RSS {rss}; "
          f"machine load average {report.machine_load_1min:.1f} on {os.cpu_count()} cores")
    for sample in report.error_samples:
        print(f"  error: {sample}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start kvreuse serve on a free port)")
    parser.add_argument("--model", help="model of the started server (default: the embedded one)")
    parser.add_argument("--store", default="memory:4GB", help="store of the started server")
    parser.add_argument("--max-concurrency", type=int, default=8, help="the started server's batch limit")
    parser.add_argument("--method", default="cacheblend:0.15", help="reuse method of every request")
    parser.add_argument("--dataset", default="../shared/datasets/hotpotqa.jsonl")
    parser.add_argument("--pool", type=int, default=8, help="distinct rows the requests draw from")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=60, help="seconds during which clients send requests")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = load_dataset(args.dataset, limit=args.pool).prompts
    server, url = (None, args.url) if args.url else start_server(args)
    watcher = RssWatcher(server.pid) if server else None
    try:
        outcomes, elapsed = asyncio.run(run_clients(url, prompts, args))
    finally:
        peak_rss = watcher.stop() if watcher else None
        if server:
            server.terminate()
            server.wait(timeout=60)
    report = summarise(outcomes, elapsed, peak_rss, args)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
