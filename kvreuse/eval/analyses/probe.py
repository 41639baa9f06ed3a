"""One example run through the fusion executor under any plan, with what the analyses measure recorded: the
request's final KV cache, first-token logits and the fresh rows' attention map on every layer.

The fresh rows (question, template tail) are computed at every layer by every method, so their attention is the
one map all methods share; it is also what the first generated token is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.eval.datasets import ChunkedPrompt
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.executor import FusionStats
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.plan import FusionPlan, plan_from_rows
from kvreuse.fusion.segments import Segment, SegmentKind
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel

PLAIN = "naive"  # a method whose chunks are compiled plainly (no dummy tokens), for stored-KV lookups


class FreshAttention:
    """Executor observer keeping, per layer, the attention probabilities [Hq, fresh rows, prompt rows] of the
    rows at or after `fresh_start`."""

    def __init__(self, model: LayerwiseModel, fresh_start: int):
        self.model, self.fresh_start = model, fresh_start
        self.maps: list[torch.Tensor] = []

    def __call__(self, layer: int, queries: torch.Tensor, rows: torch.Tensor, cache: KVCache) -> None:
        fresh = rows >= self.fresh_start
        keys, _ = cache.layer(layer)
        positions = cache.positions
        self.maps.append(self.model.attention_weights(layer, queries[fresh], positions[rows[fresh]], keys, positions))


@dataclass
class Observed:
    logits: torch.Tensor  # [vocab]
    cache: KVCache
    attention: list[torch.Tensor]  # per layer: [Hq, fresh rows, prompt rows]
    stats: FusionStats


def kv_deviation(cache: KVCache, reference: KVCache, rows: torch.Tensor) -> torch.Tensor:
    """CacheBlend's per-token KV deviation, [layers, rows]: the L2 distance of each row's K (after RoPE) and V,
    taken together, from the reference's."""
    per_layer = []
    for layer in range(cache.num_layers):
        (k, v), (k_ref, v_ref) = cache.layer(layer), reference.layer(layer)
        squared = [(x[rows] - ref[rows]).float().square().sum((1, 2)) for x, ref in ((k, k_ref), (v, v_ref))]
        per_layer.append((squared[0] + squared[1]).sqrt())
    return torch.stack(per_layer)


def attention_deviation(attention: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """Per layer: the L2 distance between a query row's attention distribution and the reference's, averaged
    over heads and query rows, [layers]."""
    return torch.stack([(a - r).norm(dim=-1).mean() for a, r in zip(attention, reference)])


def attention_mass(attention: list[torch.Tensor], columns: torch.Tensor) -> torch.Tensor:
    """Per layer: the share of attention the query rows put on `columns`, averaged over heads and rows."""
    return torch.stack([a[..., columns].sum(-1).mean() for a in attention])


class ExampleProbe:
    """One dataset example on an engine: its chunks compiled, full prefill run once as the reference, and any
    method or recomputed row set run and observed against it."""

    def __init__(self, engine: ReuseEngine, prompt: ChunkedPrompt, methods: tuple[str, ...] = (PLAIN,)):
        self.engine, self.prompt = engine, prompt
        self.request = engine.build_request(prompt.chunks, prompt.question)
        engine.compile(self.request, [PLAIN, *methods])
        self.chunks: list[Segment] = self.request.of_kind(SegmentKind.CHUNK)
        self.fresh_start = self.request.of_kind(SegmentKind.FRESH)[0].start
        self.chunk_rows = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in self.chunks])
        self.full = self.run_method("full")

    def run_method(self, method: str) -> Observed:
        policy = parse_method(method)
        return self._execute(policy.plan(self.request, self.engine.lookup(self.request, policy)))

    def run_rows(self, rows: torch.Tensor, label: str = "selection") -> Observed:
        """Recompute the given chunk rows (prompt row indices) from layer 0 on and load every other chunk row."""
        placed = self.engine.lookup(self.request, parse_method(PLAIN))
        recompute = {
            i: rows[(rows >= p.segment.start) & (rows < p.segment.start + len(p.segment.token_ids))] - p.segment.start
            for i, p in enumerate(placed)
            if p.segment.kind == SegmentKind.CHUNK
        }
        return self._execute(plan_from_rows(label, self.request, placed, recompute))

    def _execute(self, plan: FusionPlan) -> Observed:
        observer = FreshAttention(self.engine.model, self.fresh_start)
        result = self.engine.executor.run(plan, self.request.token_ids, observer=observer)
        return Observed(result.logits, result.cache, observer.maps, result.stats)

    def stored_kv(self, chunk: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's stored KV as compiled alone, [layers, tokens, heads, dim], keys before RoPE."""
        entry = self.engine.store.get(self.engine.key_of(self.request, chunk, parse_method(PLAIN)))
        if entry is None:
            raise RuntimeError(f"chunk at row {chunk.start} is not in the store")
        return entry.k, entry.v

    def kv_deviation(self, observed: Observed) -> torch.Tensor:
        """[layers, chunk rows]: deviation of each chunk token's KV from full prefill's."""
        return kv_deviation(observed.cache, self.full.cache, self.chunk_rows)

    def fidelity(self, observed: Observed) -> dict[str, float]:
        """How far a run is from full prefill: attention and KV deviation averaged over layers, first-token KL."""
        return {
            "attention_deviation": float(attention_deviation(observed.attention, self.full.attention).mean()),
            "kv_deviation": float(self.kv_deviation(observed).mean()),
            "first_token_kl": first_token_kl(self.full.logits, observed.logits),
        }

    def chunk_starts(self, tokens: int = 1) -> torch.Tensor:
        """Prompt rows of the first `tokens` tokens of every chunk."""
        return torch.cat([torch.arange(c.start, c.start + min(tokens, len(c.token_ids))) for c in self.chunks])
