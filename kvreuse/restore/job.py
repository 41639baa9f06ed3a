"""One request's restoration: the KV cache being filled, and the two axes its work splits along.

The request's KVCache is the meeting place of compute and I/O: row r holds position r, a loaded block's keys
are rotated to their positions and written at their rows, a computed block writes its own. Every computation
(a prefix block, a layer of the whole prefix, the remainder after the prefix) is the same step, `PrefixJob.step`:
run one layer for a contiguous run of rows, attending over every row before their end.

Two axes say what a position of the two-pointer line is: a prefix row through every layer (TokenAxis) or one
row of one layer, layer-major (LayerAxis). On both, the I/O side reads stored blocks (whole, or the part past
the compute side's pointer) and the compute side runs short runs of rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore.units import Span
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

    def step(self, layer: int, hidden: torch.Tensor, rows: slice, capture: Capture | None = None) -> torch.Tensor:
        """Run `layer` for the rows [rows.start, rows.stop) given their entering hidden state; rows before
        rows.start must hold this layer's KV already. Writes the rows' KV, returns their output hidden state."""
        model, rotary = self.model, self.rotary[rows]
        q, k, v = model.qkv(layer, hidden)
        self.cache.write(layer, rows, model.rope(k, rotary), v)
        # Only rows up to rows.stop: later rows may be unwritten memory (NaN), which a mask does not make safe.
        keys, values = self.cache.keys[layer][: rows.stop], self.cache.values[layer][: rows.stop]
        positions = self.positions[: rows.stop]
        out = model.attend(layer, model.rope(q, rotary), positions[rows], keys, values, positions)
        if capture is not None:
            capture.k.append(k)
            capture.v.append(v)
        return model.finish_layer(layer, hidden, out)

    def run_layers(self, layers: range, hidden: torch.Tensor, rows: slice, capture: Capture | None = None
                   ) -> torch.Tensor:
        for layer in layers:
            if capture is not None and layer in capture.boundary_layers:
                capture.boundary.append(hidden)
            hidden = self.step(layer, hidden, rows, capture)
        return hidden

    def compute_rows(self, rows: slice, capture: Capture | None = None) -> torch.Tensor:
        """Rows through all of this job's layers, from their entering hidden state."""
        return self.run_layers(self.layers, self.hidden_in(rows), rows, capture)

    # ---- load -----------------------------------------------------------------------------------------

    def block_at(self, row: int) -> Block:
        return self.blocks[row // self.blocks[0].stored_tokens]

    def read(self, block: Block, layers: range, rows: slice) -> KV | None:
        """`layers` of cache rows `rows` (inside `block`) from the store, keys rotated to their positions; None
        if missing or damaged."""
        local = block.overlap(rows)
        length = local.stop - local.start
        with self.channels[block.tier]:
            if length == block.stored_tokens:
                kv = self.store.get_layers(block.key, layers.start, layers.stop)
            else:  # part of a block: the rest was computed, or the last prompt token lies in it
                kv = self.store.get_rows(block.key, torch.arange(local.start, local.stop), layers)
        if kv is None or kv[0].shape[:2] != (len(layers), length):
            return None
        k, v = kv
        self.bytes_loaded += k.nbytes + v.nbytes
        model = self.model
        k = model.rope(k.to(device=model.device, dtype=model.dtype), self.rotary[rows])
        return k, v.to(device=model.device, dtype=model.dtype)

    def place(self, rows: slice, layers: range, kv: KV) -> None:
        for i, layer in enumerate(layers):
            self.cache.write(layer, rows, kv[0][i], kv[1][i])


class TokenAxis:
    """A position is a prefix row through every layer. The compute side runs rows from the front (each run
    needs the KV of the rows before it), the I/O side loads blocks from the back (they need nothing)."""

    def __init__(self, job: PrefixJob):
        self.job = job
        self.length = job.prefix_length
        self.positions_per_token = 1
        self.token_layers = len(job.layers)

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        return min(start + size, limit)

    def load_start(self, stop: int, limit: int) -> int:
        return max(self.job.block_at(stop - 1).rows.start, limit)

    def compute(self, span: Span) -> None:
        self.job.compute_rows(slice(span.start, span.stop))

    def read(self, span: Span) -> KV | None:
        return self.job.read(self.job.block_at(span.start), self.job.layers, slice(span.start, span.stop))

    def place(self, span: Span, data: KV) -> None:
        self.job.place(slice(span.start, span.stop), self.job.layers, data)

    def recompute(self, spans: list[Span]) -> None:
        for span in spans:  # in order: each needs the rows before it, all in place by now
            self.compute(span)

    def tier(self, position: int) -> int:
        return self.job.block_at(position).tier


class LayerAxis:
    """A position is one prefix row of one layer, layer-major: position u * P + r is row r of the job's u-th
    layer (P = prefix length). The compute side runs layers bottom-up, a run of rows of one layer at a time
    (each layer needs the hidden state the whole layer below produced); the I/O side loads one layer of one
    block at a time, top-down."""

    def __init__(self, job: PrefixJob):
        self.job = job
        self.rows = job.prefix_length
        self.length = self.rows * len(job.layers)
        self.positions_per_token = len(job.layers)
        self.token_layers = 1
        self.next = 0  # the compute chain has run positions [0, next)
        self._hidden: torch.Tensor | None = None  # entering the layer the chain is on, every prefix row
        self._outputs: list[torch.Tensor] = []  # that layer's output so far

    def _cell(self, position: int) -> tuple[int, int]:
        return divmod(position, self.rows)

    def _rows(self, span: Span) -> tuple[range, slice]:
        unit, row = self._cell(span.start)
        layer = self.job.layers[unit]
        return range(layer, layer + 1), slice(row, row + len(span))

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        layer_end = (start // self.rows + 1) * self.rows
        return min(start + size, layer_end, limit)

    def load_start(self, stop: int, limit: int) -> int:
        unit, row = self._cell(stop - 1)
        return max(unit * self.rows + self.job.block_at(row).rows.start, limit)

    def compute(self, span: Span) -> None:
        assert span.start == self.next, f"layer cells are computed in order: expected {self.next}, got {span}"
        layers, rows = self._rows(span)
        if self._hidden is None:
            self._hidden = self.job.hidden_in(slice(0, self.rows))
        self._outputs.append(self.job.step(layers.start, self._hidden[rows], rows))
        if rows.stop == self.rows:  # layer done: its output enters the next one
            self._hidden, self._outputs = torch.cat(self._outputs), []
        self.next = span.stop

    def read(self, span: Span) -> KV | None:
        layers, rows = self._rows(span)
        return self.job.read(self.job.block_at(rows.start), layers, rows)

    def place(self, span: Span, data: KV) -> None:
        layers, rows = self._rows(span)
        self.job.place(rows, layers, data)

    def recompute(self, spans: list[Span]) -> None:
        # A failed cell needs the hidden state entering its layer: carry the chain on to the end of the highest
        # failed layer (cells loaded on the way are overwritten with the same KV).
        end = (max(s.stop - 1 for s in spans) // self.rows + 1) * self.rows
        while self.next < end:
            self.compute(Span(self.next, self.compute_stop(self.next, end, end)))

    def tier(self, position: int) -> int:
        return self.job.block_at(position % self.rows).tier
