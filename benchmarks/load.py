"""Soak and load benchmark of `kvreuse serve`: concurrent clients send a realistic, hostile mix for a fixed time.

The mix (shares set by --mix): RAG chats whose documents are HotpotQA passages from a small pool (documents
repeat, so their stored chunks are reused); on request (`long_rag`), RAG chats over the passages of several rows,
prompts of lengths that vary (2-7K tokens); bursts of identical requests sent at the same moment; streams the
client drops after the first token; non-streaming requests the client abandons; malformed requests of several
kinds; completions. It reports requests and errors by kind (any 5xx or transport error is the server's fault),
client-side TTFT percentiles of the streamed chats, the server's RSS over time (flat after warm-up or not),
whether the server's /metrics counted exactly what was sent, and from its histograms what the finished requests'
first tokens waited for (queue, their prompt's own computation, pauses between its layers).

    .venv/bin/python -m benchmarks.load --duration 600 --clients 8 --out runs/soak.json

By default it starts `kvreuse serve` (embedded model) on a free loopback port and stops it at the end; --url
targets a running server (its RSS is read when it listens on this machine, or from --server-pid).
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
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.eval.datasets import load_dataset

DEFAULT_MIX = "rag=0.5,identical=0.15,cancel_stream=0.1,abandon=0.05,malformed=0.15,completion=0.05"
KINDS = ("rag", "long_rag", "identical", "cancel_stream", "abandon", "malformed", "completion")
IDENTICAL_BURST = 3  # clients sending the very same request at once
# long_rag: the passages of this many rows of the pool, some of each left out, so that prompt lengths vary past the
# 2048 rows where fp32 products leave the native panels for oneDNN (which kept a primitive per length, session 39)
LONG_RAG_ROWS = (2, 4)
CANCELLED = 499  # what the server counts for a client that went away
# each sent raw, as a broken or hostile client would
MALFORMED = ["invalid_json", "wrong_type", "unknown_model", "bad_api_key", "too_long", "lone_surrogate"]
# the status an error event after a 200 header stands for, by its OpenAI error type
STREAM_ERROR_STATUS = {"timeout_error": 408, "cancelled_error": CANCELLED, "invalid_request_error": 400}


@dataclass
class Sent:
    """What the client sent and saw for one request."""

    kind: str
    endpoint: str
    status: int | None = None  # None: the client gave up (cancelled) or the transport failed
    expected: tuple[int, ...] = (200,)
    ttft: float | None = None
    error: str | None = None

    @property
    def cancelled(self) -> bool:
        return self.kind in ("cancel_stream", "abandon")

    @property
    def failure(self) -> str | None:
        """Why this request counts against the server, if it does."""
        if self.error:
            return self.error
        if self.status is not None and (self.status >= 500 or self.status not in self.expected):
            return f"{self.kind}: unexpected {self.status}"
        return None


@dataclass
class Report:
    duration_s: float
    clients: int
    sent_by_kind: dict[str, int]
    failures_by_kind: dict[str, int]
    server_errors: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    rss_mb: dict[str, float | None]
    rss_series: list[tuple[float, float]]
    metrics_rows: list[dict]
    metrics_agree: bool | None
    metrics_note: str
    machine_load_1min: float
    settings: dict = field(default_factory=dict)
    failure_samples: list[str] = field(default_factory=list)
    long_rag_ttft_s: dict[str, float] | None = None  # p50, p90, p99 of the long_rag chats, when the mix sends them
    server_waits_s: dict[str, float | None] = field(default_factory=dict)  # mean_waits over the run
    write_back_pending: float | None = None  # store writes waiting at the end
    reused_tokens: tuple[float, float] | None = None  # prompt tokens whose stored KV was reused, of all, over the run


def parse_mix(spec: str) -> dict[str, float]:
    mix = {}
    for part in spec.split(","):
        name, _, share = part.partition("=")
        if name not in KINDS:
            raise SystemExit(f"--mix: unknown kind {name!r}")
        mix[name] = float(share)
    if not sum(mix.values()) > 0:
        raise SystemExit("--mix: the shares must add up to more than 0")
    return mix


def percentile(values: list[float], p: float) -> float:
    """Linear between the two nearest samples, as numpy's (and the benches' and eval's) percentiles are."""
    return float(np.percentile(values, p)) if values else float("nan")


# ---- the server's memory ------------------------------------------------------------------------------


class RssWatcher:
    """Samples the resident memory of a process and its children every `interval` s until stopped."""

    def __init__(self, pid: int, interval: float):
        self.process, self.interval = psutil.Process(pid), interval
        self.series: list[tuple[float, float]] = []  # (seconds since start, MB)
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        rss = sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])
        self.series.append((round(time.monotonic() - self._started, 1), rss / 2**20))

    def _run(self) -> None:
        while True:
            try:
                self._sample()
            except psutil.Error:
                return
            if self._stop.wait(self.interval):
                return

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.series


def rss_summary(series: list[tuple[float, float]], warmup: float) -> dict[str, float | None]:
    """RSS after warm-up, at the end, at its peak, and its least-squares slope after warm-up (MB per minute)."""
    after = [(t, mb) for t, mb in series if t >= warmup] or series[-1:]
    if not after:
        return {"after_warmup_mb": None, "end_mb": None, "peak_mb": None, "slope_mb_per_min": None}
    slope = None
    if len(after) >= 3:
        mean_t, mean_mb = sum(t for t, _ in after) / len(after), sum(mb for _, mb in after) / len(after)
        var = sum((t - mean_t) ** 2 for t, _ in after)
        slope = 60 * sum((t - mean_t) * (mb - mean_mb) for t, mb in after) / var if var else None
    return {"after_warmup_mb": after[0][1], "end_mb": series[-1][1], "peak_mb": max(mb for _, mb in series),
            "slope_mb_per_min": slope}


def listening_pid(url: str) -> int | None:
    """The local process listening on the URL's port, if any (for --url on this machine)."""
    port = httpx.URL(url).port
    try:
        connections = psutil.net_connections("tcp")
    except psutil.Error:
        return None
    return next((c.pid for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port), None)


# ---- /metrics ---------------------------------------------------------------------------------------------


# what a finished request's first token waited for, by the server's histograms (their _sum and _count)
WAIT_PARTS = {"ttft": "kvreuse_time_to_first_token_seconds", "queue": "kvreuse_request_queue_time_seconds",
              "prefill": "kvreuse_request_prefill_time_seconds", "paused": "kvreuse_request_prefill_paused_seconds"}


# prompt tokens of the finished requests, and those of them whose stored KV was reused
REUSE_COUNTERS = {"kvreuse_prompt_tokens_total": "prompt", "kvreuse_cached_tokens_total": "cached"}


@dataclass
class Scrape:
    requests: Counter  # kvreuse_requests_total by (endpoint, code)
    has_code: bool  # whether the server labels its requests by code
    waits: Counter  # WAIT_PARTS' sums and counts: (part, "sum" | "count")
    pending_writes: float | None  # kvreuse_write_back_pending (None: the server does not export it)
    tokens: Counter = field(default_factory=Counter)  # kvreuse_prompt_tokens and kvreuse_cached_tokens: prompt, cached


def scrape(client: httpx.Client) -> Scrape:
    histograms = {f"{name}_{stat}": (part, stat) for part, name in WAIT_PARTS.items() for stat in ("sum", "count")}
    found = Scrape(Counter(), False, Counter(), None)
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "kvreuse_requests_total":
                found.has_code = found.has_code or "code" in sample.labels
                found.requests[(sample.labels.get("endpoint"), sample.labels.get("code"))] += sample.value
            elif sample.name in histograms:
                found.waits[histograms[sample.name]] += sample.value
            elif sample.name == "kvreuse_write_back_pending":
                found.pending_writes = sample.value
            elif sample.name in REUSE_COUNTERS:
                found.tokens[REUSE_COUNTERS[sample.name]] += sample.value
    return found


def mean_waits(waits: Counter) -> dict[str, float | None]:
    """Each part's mean over the requests that finished between two scrapes (None: none finished, or the
    server does not export the part); `other` is what the parts leave of the TTFT (the prompts prefilled before
    a request in its admission batch, its stored prefix restored together with theirs, its first token's
    sampling)."""
    means = {part: waits[part, "sum"] / waits[part, "count"] if waits[part, "count"] else None for part in WAIT_PARTS}
    parts = [means[p] for p in ("queue", "prefill", "paused")]
    means["other"] = None if None in parts or means["ttft"] is None else means["ttft"] - sum(parts)
    return means


def agreement(sent: list[Sent], counted: Counter) -> tuple[list[dict], bool]:
    """Rows of (endpoint, status): sent vs counted, and whether all agree. A request the client cancelled may
    have finished first (a race no client can close): those are compared as the sum of 200 and 499."""
    tally: Counter = Counter()
    for s in sent:
        if s.cancelled:
            tally[(s.endpoint, "200|499")] += 1
        elif s.status is not None:
            tally[(s.endpoint, str(s.status))] += 1
    counted = Counter({key: value for key, value in counted.items() if value})
    raced = {endpoint for endpoint, code in tally if code == "200|499"}
    for endpoint in raced:
        cancels = counted.pop((endpoint, str(CANCELLED)), 0)
        finished_beyond = counted.get((endpoint, "200"), 0) - tally.get((endpoint, "200"), 0)
        counted[(endpoint, "200|499")] = cancels + max(0, finished_beyond)
        counted[(endpoint, "200")] -= max(0, finished_beyond)
    keys = sorted(set(tally) | {k for k, v in counted.items() if v})
    rows = [{"endpoint": e, "status": c, "sent": tally.get((e, c), 0), "counted": counted.get((e, c), 0)}
            for e, c in keys]
    return rows, all(r["sent"] == r["counted"] for r in rows)


# ---- the requests -------------------------------------------------------------------------------------------


def long_rag_prompt(prompts: list, rng: random.Random):
    """A prompt over the passages of several rows of the pool, each row's passages cut at a random count: the
    question of the first."""
    rows = rng.sample(prompts, min(len(prompts), rng.randint(*LONG_RAG_ROWS)))
    chunks = [chunk for row in rows for chunk in row.chunks[: rng.randint(max(1, len(row.chunks) // 2),
                                                                         len(row.chunks))]]
    return replace(rows[0], chunks=chunks)


def chat_body(model: str, prompt, args: argparse.Namespace, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt.question}], "documents": prompt.chunks,
            "max_tokens": args.max_tokens, "temperature": 0, "kvreuse": {"method": args.method}, **extra}


async def streamed(client: httpx.AsyncClient, s: Sent, url: str, body: dict, stop_after_first: bool) -> None:
    """Stream a chat or completion, timing its first text; with `stop_after_first`, leave right after it."""
    started = time.perf_counter()
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        s.status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                s.status = STREAM_ERROR_STATUS.get(event["error"]["type"], 500)
            elif s.ttft is None and any(c.get("text") or c.get("delta", {}).get("content")
                                        for c in event.get("choices", [])):
                s.ttft = time.perf_counter() - started
                if stop_after_first:
                    s.status = None  # the client leaves: the server should count it cancelled
                    return


async def malformed(client: httpx.AsyncClient, s: Sent, model: str, api_key: str | None, rng: random.Random) -> None:
    name = rng.choice([m for m in MALFORMED if api_key or m != "bad_api_key"])
    s.kind = f"malformed:{name}"
    json_headers = {"content-type": "application/json"}
    url = "/v1/chat/completions"
    good = {"model": model, "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 2}
    if name == "invalid_json":
        s.expected, request = (400,), client.post(url, content=b'{"model": ', headers=json_headers)
    elif name == "wrong_type":
        s.expected, request = (400,), client.post(url, json={**good, "temperature": "hot"})
    elif name == "unknown_model":
        s.expected, request = (404,), client.post(url, json={**good, "model": "no-such-model"})
    elif name == "bad_api_key":
        s.expected, request = (401,), client.post(url, json=good, headers={"authorization": "Bearer wrong"})
    elif name == "too_long":
        s.expected, request = (400,), client.post(url, json={**good, "messages": [
            {"role": "user", "content": "word " * 20000}]})
    else:
        raw = json.dumps({**good, "messages": [{"role": "user", "content": "caf\ud800"}]}).encode()
        s.expected, request = (400,), client.post(url, content=raw, headers=json_headers)
    s.status = (await request).status_code


async def send(kind: str, client: httpx.AsyncClient, model: str, prompts: list, args: argparse.Namespace,
               rng: random.Random) -> list[Sent]:
    """One request of `kind` (a burst of them for `identical`), with what the client saw."""
    chat = "/v1/chat/completions"
    count = IDENTICAL_BURST if kind == "identical" else 1
    sent = [Sent(kind, "completions" if kind == "completion" else "chat") for _ in range(count)]
    prompt = rng.choice(prompts)

    async def one(s: Sent) -> None:
        try:
            if kind == "rag":
                await streamed(client, s, chat, chat_body(model, prompt, args), stop_after_first=False)
            elif kind == "long_rag":
                await streamed(client, s, chat, chat_body(model, long_rag_prompt(prompts, rng), args),
                               stop_after_first=False)
            elif kind == "cancel_stream":
                await streamed(client, s, chat, chat_body(model, prompt, args, max_tokens=256, ignore_eos=True),
                               stop_after_first=True)
            elif kind == "identical":
                s.status = (await client.post(chat, json=chat_body(model, prompt, args))).status_code
            elif kind == "abandon":
                body = chat_body(model, prompt, args, max_tokens=256, ignore_eos=True)
                try:
                    s.status = (await asyncio.wait_for(client.post(chat, json=body), args.abandon_after)).status_code
                except TimeoutError:
                    s.status = None
            elif kind == "completion":
                body = {"model": model, "prompt": prompt.question, "max_tokens": args.max_tokens, "temperature": 0}
                await streamed(client, s, "/v1/completions", body, stop_after_first=False)
            else:
                await malformed(client, s, model, args.api_key, rng)
        except httpx.HTTPError as e:
            s.error = f"{kind}: {type(e).__name__}: {e}"

    await asyncio.gather(*(one(s) for s in sent))
    return sent


async def client_loop(url: str, model: str, prompts: list, args: argparse.Namespace, seed: int, deadline: float,
                      sent: list[Sent]) -> None:
    rng = random.Random(seed)
    mix = parse_mix(args.mix)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.request_timeout) as client:
        while time.perf_counter() < deadline:
            kind = rng.choices(list(mix), weights=list(mix.values()))[0]
            sent.extend(await send(kind, client, model, prompts, args, rng))


# ---- running it -----------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "kvreuse.cli", "serve", *([args.model_path] if args.model_path else []),
               "--port", str(port), "--store", args.store, "--max-concurrency", str(args.max_concurrency),
               "--log-level", "warning", *(["--api-key", args.api_key] if args.api_key else [])]
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


def served_model(client: httpx.Client, asked: str | None) -> str:
    if asked:
        return asked
    models = client.get("/v1/models")
    if models.status_code != 200:
        raise SystemExit(f"GET /v1/models answered {models.status_code}: {models.text[:200]} (--api-key?)")
    return models.json()["data"][0]["id"]


def run(url: str, server_pid: int | None, args: argparse.Namespace) -> Report:
    prompts = load_dataset(args.dataset, limit=args.pool).prompts
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as control:
        model = served_model(control, args.model)
        before = scrape(control)
        watcher = RssWatcher(server_pid, args.rss_interval) if server_pid else None
        sent: list[Sent] = []
        started = time.perf_counter()
        deadline = started + args.duration

        async def clients() -> None:
            await asyncio.gather(*(client_loop(url, model, prompts, args, i, deadline, sent)
                                   for i in range(args.clients)))

        try:
            asyncio.run(clients())
            elapsed = time.perf_counter() - started
            time.sleep(2)  # cancellations reach the server's metrics once the engine notices them
            after = scrape(control)
        finally:
            series = watcher.stop() if watcher else []
    report = summarise(sent, after.requests - before.requests, before.has_code, series, elapsed, args)
    report.server_waits_s = mean_waits(after.waits - before.waits)
    report.write_back_pending = after.pending_writes
    tokens = after.tokens - before.tokens
    report.reused_tokens = (tokens["cached"], tokens["prompt"]) if tokens["prompt"] else None
    return report


def summarise(sent: list[Sent], counted: Counter, has_code: bool, series: list[tuple[float, float]],
              elapsed: float, args: argparse.Namespace) -> Report:
    failures = [s.failure for s in sent if s.failure]
    ttfts, long_ttfts = ([s.ttft for s in sent if s.kind == kind and s.status == 200 and s.ttft is not None]
                         for kind in ("rag", "long_rag"))
    rows, agree = agreement(sent, counted)
    note = "sent vs counted by /metrics (cancelled requests may have finished first: compared as 200|499)"
    if not has_code:
        agree, note = None, "metrics lack label code: server too old to compare"
    return Report(
        duration_s=round(elapsed, 1), clients=args.clients,
        sent_by_kind=dict(Counter(s.kind.partition(":")[0] for s in sent)),
        failures_by_kind=dict(Counter(f.partition(":")[0] for f in failures)),
        server_errors=sum(1 for s in sent if s.status is not None and s.status >= 500),
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90), ttft_p99_s=percentile(ttfts, 99),
        rss_mb=rss_summary(series, args.warmup), rss_series=series, metrics_rows=rows, metrics_agree=agree,
        metrics_note=note, machine_load_1min=os.getloadavg()[0],
        settings={k: v for k, v in vars(args).items() if k not in ("out", "api_key")},
        failure_samples=failures[:10],
        long_rag_ttft_s={f"p{p}": percentile(long_ttfts, p) for p in (50, 90, 99)} if long_ttfts else None,
    )


def print_report(report: Report) -> None:
    total = sum(report.sent_by_kind.values())
    print(f"{report.clients} clients, {report.duration_s} s: {total} requests sent "
          + ", ".join(f"{k} {v}" for k, v in sorted(report.sent_by_kind.items())))
    print(f"failures: {sum(report.failures_by_kind.values())} {report.failures_by_kind or ''}; "
          f"server errors (5xx): {report.server_errors}")
    print(f"RAG TTFT p50 {report.ttft_p50_s:.2f} s, p90 {report.ttft_p90_s:.2f} s, p99 {report.ttft_p99_s:.2f} s")
    if report.long_rag_ttft_s:
        print("long RAG TTFT " + ", ".join(f"{p} {s:.2f} s" for p, s in report.long_rag_ttft_s.items()))
    rss = report.rss_mb
    if rss.get("end_mb") is not None:
        slope = rss["slope_mb_per_min"]
        print(f"server RSS: {rss['after_warmup_mb']:.0f} MB after warm-up, {rss['end_mb']:.0f} MB at the end, "
              f"peak {rss['peak_mb']:.0f} MB, slope after warm-up "
              + ("n/a" if slope is None else f"{slope:+.1f} MB/min"))
    else:
        print("server RSS: not measured (no local server process)")
    waits, pending = report.server_waits_s, report.write_back_pending
    if waits.get("other") is not None:
        print(f"server's first-token wait, mean of the finished requests: TTFT {waits['ttft']:.2f} s = queue "
              f"{waits['queue']:.2f} + prefill {waits['prefill']:.2f} + paused {waits['paused']:.2f} + other "
              f"{waits['other']:.2f}; store writes pending at the end: "
              + ("n/a" if pending is None else f"{pending:.0f}"))
    if report.reused_tokens:
        cached, prompt = report.reused_tokens
        print(f"prompt tokens reused from the store: {cached:.0f} of {prompt:.0f} ({cached / prompt:.2f})")
    print(f"/metrics: {report.metrics_note}")
    for row in report.metrics_rows:
        mark = "" if row["sent"] == row["counted"] else "   <-- MISMATCH"
        print(f"  {row['endpoint']:12s} {row['status']:8s} sent {row['sent']:6d} counted {row['counted']:6.0f}{mark}")
    verdict = {True: "agree", False: "DISAGREE", None: "not compared"}[report.metrics_agree]
    print(f"metrics {verdict}; machine load average {report.machine_load_1min:.1f} on {os.cpu_count()} cores")
    for sample in report.failure_samples:
        print(f"  failure: {sample}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start kvreuse serve on a free port)")
    parser.add_argument("--api-key", default=os.environ.get("KVREUSE_API_KEY"),
                        help="the server's API key (default: $KVREUSE_API_KEY)")
    parser.add_argument("--model", help="the model name requests use (default: the first of GET /v1/models)")
    parser.add_argument("--server-pid", type=int, help="the server's pid, for its RSS (default: found by port)")
    parser.add_argument("--model-path", help="model of the started server (default: the embedded one)")
    parser.add_argument("--store", default="memory:4GB", help="store of the started server")
    parser.add_argument("--max-concurrency", type=int, default=8, help="the started server's batch limit")
    parser.add_argument("--method", default="cacheblend:0.15", help="reuse method of the chats")
    parser.add_argument("--mix", default=DEFAULT_MIX, help=f"kinds of request and their shares ({DEFAULT_MIX})")
    parser.add_argument("--dataset", default="../shared/datasets/hotpotqa.jsonl")
    parser.add_argument("--pool", type=int, default=8, help="distinct rows the requests draw from")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60, help="seconds during which clients send requests")
    parser.add_argument("--warmup", type=float, default=60, help="seconds before RSS should be flat")
    parser.add_argument("--rss-interval", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--abandon-after", type=float, default=1.0, help="seconds before an abandoned request")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    parse_mix(args.mix)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server, url = (None, args.url) if args.url else start_server(args)
    pid = server.pid if server else args.server_pid or listening_pid(url)
    try:
        report = run(url, pid, args)
    finally:
        if server:
            server.terminate()
            server.wait(timeout=60)
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(report), indent=2))
    return 0 if not report.failures_by_kind and report.metrics_agree is not False else 1


if __name__ == "__main__":
    sys.exit(main())
