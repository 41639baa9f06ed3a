"""Prometheus metrics, in a registry of the server's own (several servers can live in one process, as in tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from kvreuse.engine.generate import Generation
from kvreuse.engine.stats import PrefixRestoreStats
from kvreuse.engine.write_back import WriteBack
from kvreuse.store.base import KVStore, Tier

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
NOTHING_RAN_SECONDS = 0.001  # a prompt's pauses when nothing ran in them: the checks for cancellation between layers


STORE_EVENTS = ("damaged", "unavailable", "write_errors", "wrong_model", "evictions")


class StoreEvents:
    """`kvreuse_store_events_total{tier, event}`, read from the tiers' own counters at scrape time (not from
    `stats()`, which may scan a tier to size it)."""

    def __init__(self, store: KVStore):
        self.tiers = [t for t in getattr(store, "tiers", [store]) if isinstance(t, Tier)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("kvreuse_store_events", "store faults and evictions, by tier",
                                     labels=["tier", "event"])
        for tier in self.tiers:
            counters = asdict(tier.counters)
            for event in STORE_EVENTS:
                family.add_metric([tier.name, event], counters[event])
        yield family


class WriteBackCounters:
    """`kvreuse_write_back_dropped_total` and `_held_back_total`, read from the write-back's own counts at scrape
    time."""

    def __init__(self, write_back: WriteBack):
        self.write_back = write_back

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("kvreuse_write_back_dropped", "store writes dropped from a full write-back queue "
                                  "(their chunks are computed again when next asked for)",
                                  value=self.write_back.dropped)
        yield CounterMetricFamily("kvreuse_write_back_held_back", "chunks not compiled on their first request "
                                  "while the engine was busy (compiled on their second)",
                                  value=self.write_back.held_back)


class Metrics:
    def __init__(self, waiting: Callable[[], int], running: Callable[[], int], store: KVStore,
                 write_back: WriteBack):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvreuse_requests", "every /v1 request, by endpoint, outcome and HTTP status",
                                ["endpoint", "outcome", "code"], registry=r)
        self.queue_rejections = Counter("kvreuse_queue_rejections", "requests refused because the queue was full",
                                        registry=r)
        self.prompt_tokens = Counter("kvreuse_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvreuse_cached_tokens", "prompt tokens whose stored KV was reused", registry=r)
        self.generation_tokens = Counter("kvreuse_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("kvreuse_time_to_first_token_seconds", "arrival to first token, queueing included",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvreuse_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        # what a first token waited for: the queue, its prompt's own computation, other work between its layers
        self.queue_time = Histogram("kvreuse_request_queue_time_seconds", "arrival to the start of its prefill",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram(
            "kvreuse_request_prefill_time_seconds", "its prompt's fusion plan: computation and waits for stored "
            "KV, without the pauses between its layers", buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_paused = Histogram(
            "kvreuse_request_prefill_paused_seconds", "decoding steps and store writes run between its prompt's "
            "layers (--max-token-gap-ms)", buckets=(NOTHING_RAN_SECONDS,) + LATENCY_BUCKETS, registry=r)
        self.prefix_restorations = Counter(
            "kvreuse_prefix_restorations", "stored prefixes restored, by strategy and whether restored in a batch "
            "with other requests' (CacheFlow's batch-aware restoration) or alone", ["strategy", "mode"], registry=r)
        self.prefix_restored_tokens = Counter(
            "kvreuse_prefix_restored_tokens", "stored-prefix tokens restored, by how: loaded or recomputed",
            ["source"], registry=r)
        self.batch_size = Histogram("kvreuse_decode_batch_size", "sequences per batched decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        Gauge("kvreuse_num_requests_waiting", "requests queued", registry=r).set_function(waiting)
        Gauge("kvreuse_num_requests_running", "sequences decoding or having their prompt computed (a request of n "
              "choices counts n)",
              registry=r).set_function(running)
        Gauge("kvreuse_write_back_pending", "store writes of what requests computed (chunks to compile, prefix "
              "blocks) waiting for the engine thread", registry=r).set_function(lambda: write_back.pending)
        r.register(StoreEvents(store))
        r.register(WriteBackCounters(write_back))

    def request(self, endpoint: str, outcome: str, status: int) -> None:
        self.requests.labels(endpoint, outcome, str(status)).inc()

    def generated(self, results: list[Generation], choices_per_prompt: int = 1) -> None:
        """A finished request's tokens and latencies: its choices' generations, each prompt's together (choice
        i x n + j is prompt i's choice j); each prompt counts as a request, its KV computed once."""
        for first in range(0, len(results), choices_per_prompt):
            self._prompt_generated(results[first:first + choices_per_prompt])

    def _prompt_generated(self, results: list[Generation]) -> None:
        result = results[0]
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(result.stats.cached_tokens)
        self.generation_tokens.inc(sum(len(r.token_ids) for r in results))
        self._restored(result.stats.prefix)
        self.ttft.observe(min(r.ttft for r in results))
        self.queue_time.observe(result.stats.queue_seconds)
        self.prefill_time.observe(result.stats.fusion.prefill_seconds)
        self.prefill_paused.observe(result.stats.fusion.paused_seconds)
        self.e2e.observe(max(r.total_seconds for r in results))

    def _restored(self, prefix: PrefixRestoreStats) -> None:
        if not prefix.restored_tokens:  # nothing of its prefix was stored
            return
        self.prefix_restorations.labels(prefix.strategy, "batch" if prefix.batch > 1 else "alone").inc()
        self.prefix_restored_tokens.labels("loaded").inc(prefix.loaded_tokens)
        self.prefix_restored_tokens.labels("recomputed").inc(prefix.recomputed_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
