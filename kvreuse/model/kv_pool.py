"""Memory shared by the KV caches of sequences that decode together, so that one kernel call per layer attends
the new query of every sequence (`LayerwiseModel.step`) instead of one call per sequence.

Per layer the pool holds keys and values head-major, [slots, kv_heads, capacity, head_dim]: a slot's keys of one
head are contiguous rows, and the slots stack into the batch dimension of one attention call. A cache adopted
into a slot is a `KVCache` whose per-layer tensors are views of that slot ([capacity, kv_heads, head_dim], the
layout every other path reads and writes), so prefill, fusion and write-back use it unchanged: their attention of
several rows and their placing of stored KV run torch's kernels there, as the native ones read only rows of
contiguous heads (a cache of its own, or its `clone`).

Decoding one token reads every row of every cache once: at 16 sequences of 512 tokens, per-sequence calls over
separate caches took 54 ms per step of SmolLM2's 30 layers against 22 ms for one call per layer over a pool
(AMD EPYC Zen 4, fp32, a microbenchmark with cold caches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvreuse.model import native
from kvreuse.model.attention import attend_one_each, one_each_mask
from kvreuse.model.kv_cache import KVCache

# Capacity is allocated in steps of this many rows: a sequence a few tokens longer than the others does not
# re-allocate the pool for each of them.
CAPACITY_STEP = 256


@dataclass
class PooledStep:
    """One decoding step of member caches: what every layer's attention call shares, built once per step (at 16
    sequences, building it per layer was about 6% of the step)."""

    slots: torch.Tensor  # [B] each cache's slot
    rows: torch.Tensor  # [B] the row each cache's new KV goes to
    span: slice  # the slots the call covers, from the lowest to the highest decoding one
    at: torch.Tensor  # [B] each cache's index in the span
    lengths: torch.Tensor  # [span] the rows each slot attends (0: a slot in the span that is not decoding)
    positions: torch.Tensor  # [span] each slot's query position
    end: int  # rows of the longest cache
    # the caches fill the span's slots in order, with no hole: queries and outputs need no scatter and gather
    in_order: bool = False
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by window, built at first use

    def __len__(self) -> int:
        return self.slots.numel()


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int,
                 max_bytes: int, device: torch.device | str = "cpu", max_rows: int | None = None):
        """slots: sequences held at once; max_bytes: the most the pool's keys and values may take together (a
        sequence that would need more decodes in a cache of its own); max_rows: the most rows a sequence can hold
        (the model's window), past which growing by doubling would only allocate rows no sequence reaches."""
        if slots < 1 or max_bytes < 1:
            raise ValueError(f"a KV pool needs slots >= 1 and max_bytes >= 1, got {slots} and {max_bytes}")
        self.num_layers, self.slots, self.max_bytes, self.max_rows = num_layers, slots, max_bytes, max_rows
        self._head_shape = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions = torch.zeros((slots, 0), dtype=torch.long, device=device)
        self._members: list[KVCache | None] = [None] * slots

    @classmethod
    def for_model(cls, model, slots: int, max_bytes: int) -> KVPool:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, slots, max_bytes,
                   model.device, max_rows=model.config.max_position_embeddings)

    @property
    def members(self) -> list[KVCache]:
        return [cache for cache in self._members if cache is not None]

    def bytes_for(self, capacity: int) -> int:
        heads, dim = self._head_shape
        return 2 * self.num_layers * self.slots * heads * capacity * dim * self.dtype.itemsize

    def adopt(self, cache: KVCache, capacity: int) -> KVCache | None:
        """A copy of `cache` in a free slot, with room for `capacity` rows; None when every slot is taken or the
        pool would outgrow max_bytes. The caller keeps `cache` (it may still be read elsewhere)."""
        slot = next((i for i, member in enumerate(self._members) if member is None), None)
        capacity = max(capacity, cache.length)
        if slot is None or not self._fits(capacity):
            return None
        self.grow(capacity)
        pooled = self._empty_cache()
        pooled.pool, pooled.slot, pooled.length = self, slot, cache.length
        self._members[slot] = pooled
        self._bind(pooled)
        for layer in range(self.num_layers):
            keys, values = cache.layer(layer)
            pooled.write(layer, slice(0, cache.length), keys, values)
        pooled._positions[: cache.length] = cache.positions
        return pooled

    def release(self, cache: KVCache) -> None:
        """Free `cache`'s slot; the cache is left empty, so that a stale reference reads nothing of the sequence
        that takes the slot next."""
        if cache.pool is not self or self._members[cache.slot] is not cache:
            raise ValueError("release: the cache is not a member of this pool")
        self._members[cache.slot] = None
        cache.__dict__.update(self._empty_cache().__dict__)
        cache.pool, cache.slot = None, -1

    def _empty_cache(self) -> KVCache:
        return KVCache(self.num_layers, *self._head_shape, self.dtype, 0, self.device)

    def step_of(self, caches: list[KVCache], rows: torch.Tensor, q_pos: torch.Tensor) -> PooledStep:
        """The step in which each member cache writes its row `rows[b]` and attends its query at `q_pos[b]`."""
        slots = torch.tensor([cache.slot for cache in caches], device=self.device)
        lo, hi = int(slots.min()), int(slots.max()) + 1
        at = slots - lo
        lengths = torch.zeros(hi - lo, dtype=torch.long, device=self.device)
        lengths[at] = torch.tensor([cache.length for cache in caches], device=self.device)
        positions = torch.zeros(hi - lo, dtype=torch.long, device=self.device)
        positions[at] = q_pos
        in_order = bool(torch.equal(at, torch.arange(hi - lo, device=self.device)))
        return PooledStep(slots, rows, slice(lo, hi), at, lengths, positions, int(lengths.max()), in_order)

    def attend_one_each(self, layer: int, step: PooledStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        window: int | None, scale: float) -> torch.Tensor:
        """Write each cache's new KV of `layer` (k, v [B, Hkv, D]) at its row, then attend its query (q [B, Hq, D])
        over its cache, all in one call over the slots of the step's span; returns [B, Hq * D] in the caches'
        order. Slots in the span that are not decoding are scored and dropped (adopt fills the lowest free slot,
        so such holes are few)."""
        self.write_one_each(layer, step, k, v)
        span, end = step.span, step.end
        if step.in_order:
            queries = q
        else:
            queries = q.new_zeros((span.stop - span.start, *q.shape[1:]))
            queries[step.at] = q
        keys, values = self.keys[layer][span, :, :end], self.values[layer][span, :, :end]
        if native.decode_attention_runs(q, keys):  # masks by the positions themselves
            grouped = queries.view(queries.shape[0], keys.shape[1], -1, queries.shape[-1])
            out = native.decode_attention(grouped, keys, values, self.positions[span, :end], step.lengths,
                                          step.positions, window, scale).view(queries.shape[0], -1)
        else:
            if window not in step.masks:
                step.masks[window] = one_each_mask(step.positions, self.positions[span, :end], step.lengths, window,
                                                    q.dtype)
            out = attend_one_each(queries, keys, values, step.masks[window], scale)
        return out if step.in_order else out[step.at]

    def write_one_each(self, layer: int, step: PooledStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Each cache's new KV of `layer` (k, v [B, Hkv, D], in the caches' order) at its row."""
        self.keys[layer][step.slots, :, step.rows] = k
        self.values[layer][step.slots, :, step.rows] = v

    def _fits(self, capacity: int) -> bool:
        return self.bytes_for(max(self._rounded(capacity), self.capacity)) <= self.max_bytes

    @staticmethod
    def _rounded(capacity: int) -> int:
        return -(-capacity // CAPACITY_STEP) * CAPACITY_STEP

    def grow(self, capacity: int) -> None:
        """Room for `capacity` rows in every slot: for a cache adopted, or a member that outgrew it while decoding
        (beyond max_bytes if it must: a sequence already admitted is never dropped)."""
        if capacity <= self.capacity:
            return
        capacity = self._rounded(capacity)
        if self.bytes_for(2 * self.capacity) <= self.max_bytes:  # doubling: a growing batch re-allocates rarely
            doubled = 2 * self.capacity if self.max_rows is None else min(2 * self.capacity,
                                                                          self._rounded(self.max_rows))
            capacity = max(capacity, doubled)
        heads, dim = self._head_shape
        shape = (self.slots, heads, capacity, dim)
        # Every tensor is made before any is assigned: an allocation that fails (memory exhausted) leaves the pool as
        # it was, not grown keys beside old values, which the next pooled decoding step would read past.
        # Normal tensors, not inference tensors, even where a decoding step (under torch.inference_mode) grows the
        # pool: it outlives the step, and adopt (or a member's write) outside inference mode updates them in place.
        with torch.inference_mode(False):
            keys = [self._grown(old, shape) for old in self.keys or [None] * self.num_layers]
            values = [self._grown(old, shape) for old in self.values or [None] * self.num_layers]
            positions = torch.zeros((self.slots, capacity), dtype=torch.long, device=self.device)
            positions[:, : self.capacity] = self.positions
        self.keys, self.values, self.positions, self.capacity = keys, values, positions, capacity
        for member in self.members:
            self._bind(member)

    def _grown(self, old: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
        # Zeros, not empty memory: attention masks rows past a cache's length, but a masked probability (0) times
        # a NaN bit pattern of unwritten memory would still be NaN.
        new = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if old is not None:
            new[:, :, : old.shape[2]] = old
        return new

    def _bind(self, cache: KVCache) -> None:
        """Point the cache's per-layer tensors and positions at its slot."""
        cache.keys = [k[cache.slot].transpose(0, 1) for k in self.keys]
        cache.values = [v[cache.slot].transpose(0, 1) for v in self.values]
        cache._positions = self.positions[cache.slot]
