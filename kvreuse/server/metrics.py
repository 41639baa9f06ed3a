"""Prometheus metrics, in a registry of the server's own (several servers can live in one process, as in tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvreuse.engine.generate import Generation

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


def cached_tokens(stats: dict) -> int:
    """Prompt tokens served from the cache: chunks and prefixes placed from the store, and the conversation
    prefix restored exactly (loaded, or recomputed alongside the load by Cake/CacheFlow)."""
    return stats["reused_tokens"] + stats["restored_tokens"]


class Metrics:
    def __init__(self, waiting: Callable[[], int], running: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvreuse_requests", "requests answered, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("kvreuse_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvreuse_cached_tokens", "prompt tokens whose stored KV was reused", registry=r)
        self.generation_tokens = Counter("kvreuse_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("kvreuse_time_to_first_token_seconds", "arrival to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvreuse_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kvreuse_decode_batch_size", "sequences per batched decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        Gauge("kvreuse_num_requests_waiting", "requests queued", registry=r).set_function(waiting)
        Gauge("kvreuse_num_requests_running", "sequences being decoded", registry=r).set_function(running)

    def finished(self, endpoint: str, result: Generation) -> None:
        self.requests.labels(endpoint, "finished").inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(cached_tokens(result.stats))
        self.generation_tokens.inc(len(result.token_ids))
        self.ttft.observe(result.ttft)
        self.e2e.observe(result.total_seconds)

    def failed(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
