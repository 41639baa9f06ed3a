"""One request's restoration: the KV cache being filled, and the two axes its work splits along.

The request's KVCache is the meeting place of compute and I/O: row r holds position r, a loaded block's keys
are rotated to their positions and written at their rows, a computed block writes its own. Every computation
(a run of prefix rows, a layer of the whole prefix, the remainder after the prefix, a stage's layers) is a `Run`
of one request's contiguous rows through some of its layers. `forward` hands runs to the model's one layer loop
(`LayerwiseModel.run_layers`), whose step runs one layer for several runs at once (the batch scheduler's
requests; a lone restoration's single run), each a row group attending over its own cache's rows before its
end. Nothing here computes: this package decides which rows are loaded and which computed.

Two axes say what a position of the two-pointer line is: a prefix row through every layer (TokenAxis) or one
row of one layer, layer-major (LayerAxis). On both, the I/O side reads stored blocks (whole, or the part past
the compute side's pointer) and the compute side runs short runs of rows.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvreuse.fusion.plan import Block
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LAST_ROW, CapturedKV, LayerwiseModel, RowGroup
from kvreuse.restore.units import Span
from kvreuse.store.base import KVStore, PickedKV, metered, view_planned


class IOChannels:
    """One lock per store tier: a device serves one read at a time, whichever request or thread asks."""

    def __init__(self) -> None:
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()

    def __getitem__(self, tier: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(tier, threading.Lock())


@dataclass
class Capture(CapturedKV):
    """Stored-form KV of computed rows and their boundary activations (the hidden state entering each layer that
    starts a pipeline stage), for writing blocks back."""

    boundary_layers: list[int] = field(default_factory=list)
    boundary: list[torch.Tensor] = field(default_factory=list)

    def record(self, layer: int, hidden: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.boundary_layers:
            self.boundary.append(hidden)
        super().record(layer, hidden, k, v)


HiddenSource = Callable[[slice], torch.Tensor]


@dataclass
class Run:
    """Rows [rows.start, rows.stop) of one request through `layers`, from `hidden`, the state entering
    layers.start; the rows before rows.start hold those layers' KV already. One request's part of a step."""

    job: PrefixJob
    rows: slice
    layers: range
    hidden: torch.Tensor
    capture: Capture | None = None

    def group(self, layer: int) -> RowGroup:
        """The run as a row group of `layer`'s step: its rows attend over its own cache up to their end (later
        rows may be unwritten memory). Past the model's last layer a hidden state serves only the LM head, which
        takes the prompt's last row: there the other rows only write their KV."""
        job = self.job
        return RowGroup(job.cache, self.rows, job.positions[self.rows], job.rotary[self.rows],
                        keys_until=self.rows.stop, capture=self.capture.record if self.capture else None,
                        outputs=LAST_ROW if layer == job.model.num_layers - 1 else None)


class Runs:
    """Runs as a driver of the model's layer loop: at each layer, every run on it (of one request, or of every
    request in a batch) goes through one step together, each as its own row group."""

    def __init__(self, runs: Sequence[Run]):
        self.runs, self.hidden = runs, [run.hidden for run in runs]
        self._on: list[int] = []
        self._outputs: list[int] = []  # the rows each run on the layer gets back from its step

    @property
    def layers(self) -> list[int]:
        return sorted(set().union(*(run.layers for run in self.runs)))

    def enter(self, layer: int) -> tuple[torch.Tensor, list[RowGroup]]:
        self._on = [i for i, run in enumerate(self.runs) if layer in run.layers]
        hidden = [self.hidden[i] for i in self._on]
        groups = [self.runs[i].group(layer) for i in self._on]
        self._outputs = [len(g) if g.outputs is None else len(range(len(g))[g.outputs]) for g in groups]
        return (torch.cat(hidden) if len(hidden) > 1 else hidden[0]), groups

    def leave(self, layer: int, hidden: torch.Tensor) -> None:
        for i, out in zip(self._on, hidden.split(self._outputs)):
            self.hidden[i] = out


def forward(runs: Sequence[Run]) -> list[torch.Tensor]:
    """Every run through its own layers, bottom-up, on the model's one layer loop. Returns each run's output."""
    driver = Runs(runs)
    runs[0].job.model.run_layers(driver.layers, driver)
    return driver.hidden


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
        self.rotary = model.rotary(range(len(token_ids)))
        # The hidden state entering self.layers.start for given rows: embeddings, or a stage's boundary.
        self.hidden_in = hidden_in or (lambda rows: model.embed(token_ids[rows]))
        self.bytes_loaded = 0  # what the store's backends fetched (headers, whole row groups), as a plan counts it

    # ---- compute --------------------------------------------------------------------------------------

    def run(self, rows: slice, layers: range | None = None, hidden: torch.Tensor | None = None,
            capture: Capture | None = None) -> Run:
        """Rows through `layers` (default: all of this job's), from `hidden` (default: their entering state)."""
        layers = self.layers if layers is None else layers
        return Run(self, rows, layers, self.hidden_in(rows) if hidden is None else hidden, capture)

    def compute_rows(self, rows: slice, capture: Capture | None = None, *, layers: range | None = None,
                     hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Rows through `layers` alone (default: all of this job's, from their entering state); their output."""
        return forward([self.run(rows, layers, hidden, capture)])[0]

    # ---- load -----------------------------------------------------------------------------------------

    def block_at(self, row: int) -> Block:
        return self.blocks[row // self.blocks[0].stored_tokens]

    def read(self, block: Block, layers: range, rows: slice) -> PickedKV | None:
        """`layers` of cache rows `rows` (inside `block`) from the store, keys before RoPE; None if missing or
        damaged."""
        local = block.overlap(rows)
        length = local.stop - local.start
        # Part of a block when the rest was computed, or the last prompt token lies in it.
        part = None if length == block.stored_tokens else torch.arange(local.start, local.stop)
        with self.channels[block.tier], metered() as meter:
            kv = view_planned(self.store, block.key, layers, part, length, self.cache.form)  # placed, never written
        self.bytes_loaded += meter.bytes
        return kv

    def place(self, rows: slice, layers: range, kv: PickedKV) -> None:
        """Write what `read` gave at `rows` through the model's KV placer."""
        rotary, (keys, values, picks) = self.rotary[rows], kv
        self.model.place_layers(self.cache, layers, rows, [keys], [values], rotary, None if picks is None else [picks])


class JobAxis(ABC):
    """What both axes share: a span is computed as a `Run`, alone (`compute`) or as one request's part of a
    batched step (the batch scheduler calls `run`, `forward` and `ran` itself)."""

    def __init__(self, job: PrefixJob):
        self.job = job

    @abstractmethod
    def run(self, span: Span) -> Run:
        """The computation of `span`; every position before it is in place by the time it runs."""

    def ran(self, span: Span, hidden: torch.Tensor) -> None:
        """Take the output hidden state of `span`'s run."""

    def compute(self, span: Span) -> None:
        self.ran(span, forward([self.run(span)])[0])


class TokenAxis(JobAxis):
    """A position is a prefix row through every layer. The compute side runs rows from the front (each run
    needs the KV of the rows before it), the I/O side loads blocks from the back (they need nothing)."""

    def __init__(self, job: PrefixJob):
        super().__init__(job)
        self.length = job.prefix_length
        self.positions_per_token = 1
        self.token_layers = len(job.layers)

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        return min(start + size, limit)

    def load_start(self, stop: int, limit: int) -> int:
        return max(self.job.block_at(stop - 1).rows.start, limit)

    def run(self, span: Span) -> Run:
        return self.job.run(slice(span.start, span.stop))  # its output is not needed: the KV is in the cache

    def read(self, span: Span) -> PickedKV | None:
        return self.job.read(self.job.block_at(span.start), self.job.layers, slice(span.start, span.stop))

    def place(self, span: Span, data: PickedKV) -> None:
        self.job.place(slice(span.start, span.stop), self.job.layers, data)

    def recompute(self, spans: list[Span]) -> None:
        for span in spans:  # in order: each needs the rows before it, all in place by now
            self.compute(span)

    def tier(self, position: int) -> int:
        return self.job.block_at(position).tier


class LayerAxis(JobAxis):
    """A position is one prefix row of one layer, layer-major: position u * P + r is row r of the job's u-th
    layer (P = prefix length). The compute side runs layers bottom-up, a run of rows of one layer at a time
    (each layer needs the hidden state the whole layer below produced); the I/O side loads one layer of one
    block at a time, top-down."""

    def __init__(self, job: PrefixJob):
        super().__init__(job)
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

    def run(self, span: Span) -> Run:
        assert span.start == self.next, f"layer cells are computed in order: expected {self.next}, got {span}"
        layers, rows = self._rows(span)
        if self._hidden is None:
            self._hidden = self.job.hidden_in(slice(0, self.rows))
        return self.job.run(rows, layers, self._hidden[rows])

    def ran(self, span: Span, hidden: torch.Tensor) -> None:
        self._outputs.append(hidden)
        if span.stop % self.rows == 0:  # layer done: its output enters the next one
            self._hidden, self._outputs = torch.cat(self._outputs), []
        self.next = span.stop

    def read(self, span: Span) -> PickedKV | None:
        layers, rows = self._rows(span)
        return self.job.read(self.job.block_at(rows.start), layers, rows)

    def place(self, span: Span, data: PickedKV) -> None:
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
