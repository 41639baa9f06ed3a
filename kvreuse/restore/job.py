"""One request's restoration: the KV cache being filled, and the two axes its work splits along.

The request's KVCache is the meeting place of compute and I/O: row r holds position r, a loaded block's keys
are rotated to their positions and written at their rows, a computed block writes its own. Every computation
(a prefix block, a layer of the whole prefix, the remainder after the prefix) is the same step, `PrefixJob.step`:
run one layer for a contiguous run of rows, attending over every row before their end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore.units import Guard
from kvreuse.store.base import KV, KVStore


@dataclass(frozen=True)
class Block:
    """A stored prefix block as a request uses it: cache rows [rows.start, rows.stop) come from entry `key`.

    rows may stop short of the block's end: the last prompt token is always computed, never loaded."""

    index: int
    key: str
    rows: slice
    tier: int
    stored_tokens: int  # tokens the entry holds (the block size)

    @property
    def length(self) -> int:
        return self.rows.stop - self.rows.start

    def overlap(self, rows: slice) -> slice:
        """The part of `rows` inside this block, relative to the block's first row."""
        start, stop = max(rows.start, self.rows.start), min(rows.stop, self.rows.stop)
        return slice(start - self.rows.start, max(start, stop) - self.rows.start)


class IOChannels:
    """One lock per store tier: a device serves one read at a time, whichever request or thread asks."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def __getitem__(self, tier: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(tier, threading.Lock())


@dataclass
class Capture:
    """Stored-form KV (keys before RoPE) and boundary activations of computed rows, for writing blocks back."""

    boundary_layers: list[int]
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    boundary: list[torch.Tensor] = field(default_factory=list)


HiddenSource = Callable[[slice], torch.Tensor]


class PrefixJob:
    def __init__(
        self,
        model: LayerwiseModel,
        store: KVStore,
        token_ids: torch.Tensor,
        blocks: list[Block],
        cache: KVCache,
        *,
        layers: range,
        channels: IOChannels,
        hidden_in: HiddenSource | None = None,
    ):
        self.model, self.store, self.token_ids, self.blocks = model, store, token_ids, blocks
        self.cache, self.layers, self.channels = cache, layers, channels
        self.prefix_length = blocks[-1].rows.stop if blocks else 0
        self.positions = torch.arange(len(token_ids), device=model.device)
        self.rotary = model.rotary(self.positions)
        # The hidden state entering self.layers.start for given rows: embeddings, or a stage's boundary.
        self.hidden_in = hidden_in or (lambda rows: model.embed(token_ids[rows]))
        self.bytes_loaded = 0

    # ---- compute --------------------------------------------------------------------------------------

    def step(self, layer: int, hidden: torch.Tensor, rows: slice, capture: Capture | None = None,
             guard: Guard | None = None) -> torch.Tensor | None:
        """Run `layer` for the rows [rows.start, rows.stop) given their entering hidden state; rows before
        rows.start must hold this layer's KV already. Writes the rows' KV (through `guard`, if given: None if it
        refuses), returns their output hidden state."""
        model, rotary = self.model, self.rotary[rows]
        q, k, v = model.qkv(layer, hidden)
        rotated = model.rope(k, rotary)
        write = lambda: self.cache.write(layer, rows, rotated, v)  # noqa: E731
        if guard is None:
            write()
        elif not guard(write):
            return None
        # Only rows up to rows.stop: later rows may be unwritten memory (NaN), which a mask does not make safe.
        keys, values = self.cache.keys[layer][: rows.stop], self.cache.values[layer][: rows.stop]
        positions = self.positions[: rows.stop]
        out = model.attend(layer, model.rope(q, rotary), positions[rows], keys, values, positions)
        if guard is not None and not guard(lambda: None):  # loaded meanwhile: skip the MLP, the costliest part
            return None
        if capture is not None:
            capture.k.append(k)
            capture.v.append(v)
        return model.finish_layer(layer, hidden, out)

    def run_layers(self, layers: range, hidden: torch.Tensor, rows: slice, capture: Capture | None = None,
                   guard: Guard | None = None) -> torch.Tensor | None:
        """`rows` through `layers`; None if `guard` refused a write (the rows were loaded meanwhile)."""
        for layer in layers:
            if capture is not None and layer in capture.boundary_layers:
                capture.boundary.append(hidden)
            hidden = self.step(layer, hidden, rows, capture, guard)
            if hidden is None:
                return None
        return hidden

    def compute_rows(self, rows: slice, capture: Capture | None = None, guard: Guard | None = None
                     ) -> torch.Tensor | None:
        """Rows through all of this job's layers, from their entering hidden state."""
        return self.run_layers(self.layers, self.hidden_in(rows), rows, capture, guard)

    # ---- load -----------------------------------------------------------------------------------------

    def read(self, block: Block, layers: range) -> KV | None:
        """`layers` of `block` from the store, keys rotated to their positions; None if missing or damaged."""
        with self.channels[block.tier]:
            if block.length == block.stored_tokens:
                kv = self.store.get_layers(block.key, layers.start, layers.stop)
            else:
                kv = self.store.get_rows(block.key, torch.arange(block.length), layers)
        if kv is None or kv[0].shape[:2] != (len(layers), block.length):
            return None
        k, v = kv
        self.bytes_loaded += k.nbytes + v.nbytes
        model = self.model
        k = model.rope(k.to(device=model.device, dtype=model.dtype), self.rotary[block.rows])
        return k, v.to(device=model.device, dtype=model.dtype)

    def place(self, block: Block, layers: range, kv: KV) -> None:
        for i, layer in enumerate(layers):
            self.cache.write(layer, block.rows, kv[0][i], kv[1][i])


class TokenAxis:
    """Units are prefix blocks: computed from the front (each needs the KV of the blocks before it), loaded
    from the back (they need nothing)."""

    def __init__(self, job: PrefixJob):
        self.job = job
        self.num_units = len(job.blocks)

    def compute(self, unit: int, guard: Guard | None = None) -> None:
        self.job.compute_rows(self.job.blocks[unit].rows, guard=guard)

    def read(self, unit: int) -> KV | None:
        return self.job.read(self.job.blocks[unit], self.job.layers)

    def place(self, unit: int, data: KV) -> None:
        self.job.place(self.job.blocks[unit], self.job.layers, data)

    def recompute(self, units: list[int]) -> None:
        for unit in units:  # in order: each needs the blocks before it, all in place by now
            self.compute(unit)

    def work(self, unit: int) -> int:
        return self.job.blocks[unit].length * len(self.job.layers)

    def tier(self, unit: int) -> int:
        return self.job.blocks[unit].tier


class LayerAxis:
    """Units are layers of the whole prefix: computed bottom-up (each needs the hidden state the layer below
    produced), loaded top-down. Unit u is the job's u-th layer."""

    def __init__(self, job: PrefixJob):
        self.job = job
        self.num_units = len(job.layers) if job.blocks else 0
        self.rows = slice(0, job.prefix_length)
        self.hidden: torch.Tensor | None = None
        self.next_unit = 0  # the compute chain has run units [0, next_unit)

    def compute(self, unit: int, guard: Guard | None = None) -> None:
        assert unit == self.next_unit, f"layer units are computed in order: expected {self.next_unit}, got {unit}"
        if self.hidden is None:
            self.hidden = self.job.hidden_in(self.rows)
        self.hidden = self.job.step(self.job.layers[unit], self.hidden, self.rows, guard=guard)
        self.next_unit += 1

    def _layer(self, unit: int) -> range:
        return range(self.job.layers[unit], self.job.layers[unit] + 1)

    def read(self, unit: int) -> list[KV] | None:
        parts = []
        for block in self.job.blocks:
            kv = self.job.read(block, self._layer(unit))
            if kv is None:  # the whole layer is recomputed then
                return None
            parts.append(kv)
        return parts

    def place(self, unit: int, data: list[KV]) -> None:
        for block, kv in zip(self.job.blocks, data):
            self.job.place(block, self._layer(unit), kv)

    def recompute(self, units: list[int]) -> None:
        # A failed layer needs the hidden state entering it: carry the chain on up to the highest one (layers
        # loaded on the way are overwritten with the same KV).
        for unit in range(self.next_unit, max(units) + 1):
            self.compute(unit)

    def work(self, unit: int) -> int:
        return self.job.prefix_length

    def tier(self, unit: int) -> int:
        return max(block.tier for block in self.job.blocks)
