"""Executes every fusion plan as a driver of the model's one layer loop (`LayerwiseModel.run_layers`).

For layer i: take layer i's stored KV (a loader thread has been fetching it while layer i-1 computed; inline, the
layers one read holds, placed at once) and place it, keys rotated to their global positions (deferred RoPE);
then the model's step computes q/k/v for the selected rows and writes them over the stored rows, narrows the
selection where the plan says (CacheBlend), attends the selected queries over all keys with the exact causal
mask by position, and runs the rest of the layer for the selected rows only.
An exact prefix's stored blocks are spans of the plan like the chunks (the restorer decided which of their
rows or layers are loaded: `PrefixSplit`), so one loader reads both. A plan may instead start from a cache whose
leading rows were restored beforehand (a batch's prefixes, restored together by `kvreuse.restore.batch`): those
rows are neither loaded nor computed here.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Protocol

import torch

from kvreuse.fusion.plan import FusionPlan, Narrowing, ReusedSpan
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel, Rotary, RowGroup
from kvreuse.store.base import KVForm, KVStore, metered, view_planned
from kvreuse.store.entry import consecutive


# Layers of a span one inline read takes (a thread reading ahead takes one: its reads overlap the compute).
INLINE_LAYERS_PER_READ = 6


class StoredKVMissing(RuntimeError):
    """A stored entry the plan relies on could not be read (evicted or damaged since the lookup)."""

    def __init__(self, key: str):
        super().__init__(f"stored KV {key} could not be read")
        self.key = key


@dataclass
class FusionStats:
    """What one plan's run did: rows reused, loaded, kept and computed, bytes read, seconds, deviation checks."""

    method: str
    prompt_tokens: int
    reused_tokens: int  # rows of the reused chunks, recomputed or not (a stored prefix: PrefillStats.prefix)
    loaded_tokens: int  # rows whose stored KV was read
    kept_tokens: int  # loaded chunk rows whose stored KV serves the last layer as is (OpenAI's cached tokens,
    # with the prefix's loaded rows)
    computed_tokens_layer0: int
    recompute_share: float  # share of the reused chunk rows recomputed, averaged over layers
    computed_rows_mean: float  # all rows computed per layer (fresh ones included), averaged: the compute run
    bytes_loaded: int  # what the store's backends fetched for the plan (whole row groups, headers), not rows asked
    peak_stored_layers_held: int
    load_seconds: float
    prefix_load_seconds: float  # of load_seconds, reading an exact prefix's stored blocks
    load_wait_seconds: float
    loads_overlapped: bool
    prefill_seconds: float  # the plan's own time: without paused_seconds
    paused_seconds: float  # other work run between its layers (a server's decoding steps: model.between_layers)
    deviation_checks: list[DeviationCheck]

    @property
    def deviation_mass(self) -> float | None:
        """The first check's mass: the request's own fidelity signal (kvreuse eval keeps it per example)."""
        return self.deviation_checks[0].mass if self.deviation_checks else None

    @property
    def deviation_residual(self) -> float | None:
        return self.deviation_checks[0].residual if self.deviation_checks else None

    def record(self) -> dict:
        """The scalar figures, flat, for JSON records."""
        scalars = {k: v for k, v in asdict(self).items() if k != "deviation_checks"}
        return scalars | {"deviation_mass": self.deviation_mass, "deviation_residual": self.deviation_residual}


@dataclass
class FusionResult:
    logits: torch.Tensor  # [vocab], after the last prompt token
    cache: KVCache
    stats: FusionStats


@dataclass
class StoredLayers:
    """The stored KV of `layers` consecutive layers (one, unless an inline read took several) of every span loaded
    on them, in the spans' order: each span's keys and values [layers, rows, heads, dim], and the rows to pick from
    them (None: they are its rows)."""

    layers: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    picks: list[torch.Tensor | None]


class LayerLoader:
    """Fetches each layer's stored KV for all reused spans (chunks and an exact prefix's blocks alike) as
    `StoredLayers`, in the spans' order (the plan's `loaded_rows_at(layer)`), which the model places in one pass
    without joining them, picking a span's rows where a tier handed out its layer whole (`view_picking`).

    Threaded, it reads `lookahead` layers ahead of the compute: layer i+1 once the consumer has placed layer i
    in the request's KV cache (`placed`), so the read waits while layer i computes; a prefix restored
    layer-wise lets it read its upper layers while the lower ones compute, as CacheFlow's layer pointer does.
    Inline, `take` reads the layer on the caller's thread: on a CPU host a read that is CPU work itself (a
    memory or page-cached disk tier) gains nothing from overlap and a thread beside the compute's threads only
    slows both (kvreuse.store.base, `reads_wait`).
    Each read takes `layers_per_read` layers of a span (every layer for a `read_whole` span): a read pays a call's
    cost (the tier's look-up, a file's open and header, checks) beside its bytes, which per layer and chunk was
    most of a page-cached disk read. Inline, `take` hands out every layer the reads of all spans loaded on it hold
    (up to the layer where another span starts loading), placed in one call. At most `lookahead` layers of stored
    KV, or `layers_per_read` of each span, are alive at a time (`peak_layers_held` measures it).
    """

    def __init__(self, store: KVStore | None, spans: list[ReusedSpan], num_layers: int, form: KVForm,
                 thread: ThreadPoolExecutor | None = None, lookahead: int = 1, layers_per_read: int = 1):
        """form: the rows the cache they are placed in holds (KVCache.form); thread: where the loader reads ahead
        (the executor's own I/O thread); None: inline."""
        self.store, self.num_layers, self.form, self.layers_per_read = store, num_layers, form, layers_per_read
        self.spans = [s for s in spans if s.load.numel()]
        self.threaded = thread is not None and bool(self.spans)
        self.read_seconds = 0.0
        self.read_seconds_by_key: dict[str, float] = {}
        self.wait_seconds = 0.0
        self.bytes_read = 0
        self.peak_layers_held = 0  # measured, not assumed: layers read and not yet placed
        self._held = 0
        self._lock = threading.Lock()
        self._ready: list[threading.Event] = [threading.Event() for _ in range(num_layers)]
        self._layers: list[StoredLayers | BaseException | None] = [None] * num_layers
        self._may_read = threading.Semaphore(max(1, lookahead))
        # span -> (first layer, end layer, keys, values, picks) of the layers read at once with the last read of it
        self._ahead: dict[int, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._closed = False
        if self.threaded:
            thread.submit(self._run)

    def _read(self, index: int, span: ReusedSpan, layer: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                       torch.Tensor | None, int]:
        """Span `index`'s layers from `layer` to the end of the read that holds it, the rows to pick from them and
        that end: taken from the layers read with an earlier one, or read now with the next ones."""
        ahead = self._ahead.get(index)
        if ahead is not None:
            first, end, k, v, picks = ahead
            if layer < end:
                return k[layer - first :], v[layer - first :], picks, end
            del self._ahead[index]
        stop = self.num_layers if span.read_whole else min(self.num_layers, layer + self.layers_per_read)
        layers = range(layer, stop)
        start = time.perf_counter()
        rows = None if span.reads_whole_entry else span.load
        kv = view_planned(self.store, span.key, layers, rows, span.load.numel(), self.form)  # placed, never written
        if kv is None:
            raise StoredKVMissing(span.key)
        seconds = time.perf_counter() - start
        self.read_seconds_by_key[span.key] = self.read_seconds_by_key.get(span.key, 0.0) + seconds
        if len(layers) > 1:
            self._ahead[index] = (layer, layers.stop, *kv)
        return kv[0], kv[1], kv[2], layers.stop

    def _read_layer(self, layer: int) -> None:
        """Read `layer` of every span loaded on it into its slot, with the layers after it that the reads hold
        where inline (or the error that stopped it); mark it ready."""
        start = time.perf_counter()
        try:
            with metered() as meter:
                kv = [self._read(i, span, layer) for i, span in enumerate(self.spans) if span.reads_from <= layer]
            self.bytes_read += meter.bytes
            keys, values, picks, ends = (list(parts) for parts in zip(*kv))
            del kv
            # inline, the layers every span's read holds, up to the first a span not loaded on `layer` is loaded on
            stop = min(ends + [s.reads_from for s in self.spans if s.reads_from > layer])
            count = 1 if self.threaded else stop - layer
            self._layers[layer] = StoredLayers(count, [k[:count] for k in keys], [v[:count] for v in values], picks)
            del keys, values
            ahead = max((end - layer - count for _, end, *_ in self._ahead.values()), default=0)
            with self._lock:
                self._held += count
                self.peak_layers_held = max(self.peak_layers_held, self._held + ahead)
        except BaseException as e:  # handed to the consumer, which raises it on its own thread
            self._layers[layer] = e
        self.read_seconds += time.perf_counter() - start
        self._ready[layer].set()

    def reads(self, layer: int) -> bool:
        """Whether any span is loaded on `layer`."""
        return any(span.reads_from <= layer for span in self.spans)

    def _run(self) -> None:
        for layer in filter(self.reads, range(self.num_layers)):
            self._may_read.acquire()
            if self._closed:
                return
            self._read_layer(layer)
            if isinstance(self._layers[layer], BaseException):
                return

    def take(self, layer: int) -> StoredLayers | None:
        if not self.reads(layer):
            return None
        if not self.threaded:
            self._read_layer(layer)
        start = time.perf_counter()
        self._ready[layer].wait()
        self.wait_seconds += time.perf_counter() - start
        kv, self._layers[layer] = self._layers[layer], None
        if isinstance(kv, BaseException):
            raise kv
        return kv

    def placed(self, layers: int) -> None:
        """The consumer has copied the `layers` it took into the request's KV cache and dropped them."""
        with self._lock:
            self._held -= layers
        self._may_read.release()

    def close(self) -> None:
        # Unblock a loader still waiting for its turn, so that it stops.
        self._closed = True
        self._may_read.release()


class LayerObserver(Protocol):
    """Sees each layer as it runs (analyses read attention from it): the rotated queries of the rows computed
    on `layer`, those rows, and the request's KV cache with `layer` complete."""

    def __call__(self, layer: int, queries: torch.Tensor, rows: torch.Tensor, cache: KVCache) -> None: ...


class PlanRows:
    """A fusion plan as a driver of the model's layer loop: before each layer its stored KV is placed, then the
    selected rows go through the step, narrowing where the plan says (CacheBlend's deviation check); rows of a
    prefix restored layer-wise leave the selection where their stored layers start."""

    def __init__(self, model: LayerwiseModel, plan: FusionPlan, cache: KVCache, token_ids: torch.Tensor,
                 loader: LayerLoader, observer: LayerObserver | None):
        self.model, self.plan, self.cache, self.loader, self.observer = model, plan, cache, loader, observer
        device = model.device
        self.rotary = model.rotary(range(plan.num_rows))
        # Deferred RoPE: one rotation of the loaded rows' positions for every layer that loads the same rows.
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.leaving = {layer: rows.to(device) for layer, rows in plan.leaving_rows().items()}
        self.approximate = plan.approximate_mask.to(device)
        self.narrowable = plan.narrowable_mask.to(device)
        self.narrowing = {n.layer: n for n in plan.narrowing}
        self.checks: list[DeviationCheck] = []
        self.computed_rows: list[tuple[int, int]] = []  # (approximate rows, all rows) computed per layer
        self._placed_until = 0  # layers below hold their stored KV (an inline read's layers are placed at once)
        self._select(plan.compute_rows.to(device))
        self.hidden = model.embed(token_ids.to(device)[self.selected])

    def _select(self, rows: torch.Tensor) -> None:
        """The rows computed from here on. What the step needs of them (their row group, rotary tables, count of
        approximate rows) is built again only when they change, which most layers do not (a kept row group also
        keeps the step's shape: `LayerwiseModel._shape_of`)."""
        self.selected = rows
        self._groups: list[RowGroup] | None = None
        self._approximate_selected: int | None = None

    def loaded_at(self, layer: int) -> tuple[torch.Tensor | slice, Rotary]:
        """The rows whose stored KV `layer` loads, and their rotary tables."""
        start = max((s.reads_from for s in self.plan.reused if s.reads_from <= layer), default=0)
        if start not in self._loaded:
            rows = self.plan.loaded_rows_at(layer).to(self.model.device)
            self._loaded[start] = _as_slice(rows), self.rotary[rows]
        return self._loaded[start]

    def enter(self, layer: int) -> tuple[torch.Tensor, list[RowGroup]]:
        stored = self.loader.take(layer) if layer >= self._placed_until else None
        if stored is not None:
            rows, rotary = self.loaded_at(layer)
            self._placed_until = layer + stored.layers
            self.model.place_layers(self.cache, range(layer, self._placed_until), rows, stored.keys, stored.values,
                                    rotary, stored.picks)
            del stored
            self.loader.placed(self._placed_until - layer)
        if layer in self.leaving:  # from here on these rows' KV is loaded: their hidden state is not needed
            staying = ~torch.isin(self.selected, self.leaving[layer])
            self._select(self.selected[staying])
            self.hidden = self.hidden[staying]
        outputs = self.model.outputs_at(layer)
        if layer in self.narrowing:
            return self.hidden, [RowGroup(self.cache, self.selected, self.selected, self.rotary[self.selected],
                                          narrow=self._narrow, observe=self.observer, outputs=outputs)]
        if outputs is not None:
            return self.hidden, [replace(group, outputs=outputs) for group in self._kept_groups()]
        return self.hidden, self._kept_groups()

    def _kept_groups(self) -> list[RowGroup]:
        if self._groups is None:
            # Consecutive rows (full prefill's, naive's question) are written into the cache as a slice, a plain
            # copy where an index takes an indexed put (~4x the time); an observer is handed the rows' indices.
            rows = self.selected if self.observer is not None else _as_slice(self.selected)
            self._groups = [RowGroup(self.cache, rows, self.selected, self.rotary[self.selected],
                                     observe=self.observer)]
        return self._groups

    def _narrow(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        narrowing, approximate = self.narrowing[layer], self.approximate
        weights = (question_attention(self.model, layer, q, self.selected, k, approximate)
                   if narrowing.query_aware else None)
        keep, check = most_deviating(narrowing, self.plan.approximate_rows, self.cache, self.selected, k, v,
                                     self.narrowable[self.selected], weights)
        self.checks.append(check)
        self._select(self.selected[keep])
        return keep

    def leave(self, layer: int, hidden: torch.Tensor) -> None:
        self.hidden = hidden
        if self._approximate_selected is None:
            self._approximate_selected = int(self.approximate[self.selected].sum())
        self.computed_rows.append((self._approximate_selected, self.selected.numel()))


class FusionExecutor:
    def __init__(self, model: LayerwiseModel, store: KVStore | None):
        self.model, self.store = model, store
        self._io_thread: ThreadPoolExecutor | None = None  # the loaders' thread, as long-lived as the executor

    def io_thread(self) -> ThreadPoolExecutor:
        if self._io_thread is None:
            self._io_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-loader")
        return self._io_thread

    def close(self) -> None:
        if self._io_thread is not None:
            self._io_thread.shutdown(wait=True)
            self._io_thread = None

    @torch.inference_mode()
    def run(self, plan: FusionPlan, token_ids: torch.Tensor, extra_capacity: int = 0,
            restored: KVCache | None = None, observer: LayerObserver | None = None,
            overlap_loads: bool = True) -> FusionResult:
        """restored: the cache a plan with restored rows starts from (its rows at positions 0.., the first
        plan.restored_rows of them filled with exact KV, e.g. by `PrefixRestorer.restore_prefix`); the plan
        fills the rest of it. observer: called after each layer's KV is written (analyses). overlap_loads: read
        each layer on a loader thread while the previous one computes, or inline (see LayerLoader)."""
        model, started, paused_before = self.model, time.perf_counter(), self.model.seconds_between_layers()
        cache = self._starting_cache(plan, restored, extra_capacity)
        # A prefix restored layer-wise is read from its first stored layer on while the layers below compute.
        lookahead = model.num_layers if any(s.from_layer for s in plan.reused) else 1
        loader = LayerLoader(self.store, plan.reused, model.num_layers, cache.form,
                             self.io_thread() if overlap_loads else None, lookahead,
                             1 if overlap_loads else INLINE_LAYERS_PER_READ)
        try:
            rows = PlanRows(model, plan, cache, token_ids, loader, observer)
            model.run_layers(range(model.num_layers), rows)
        finally:
            loader.close()
        logits = model.logits(rows.hidden[-1:])[0]
        paused = model.seconds_between_layers() - paused_before
        elapsed = time.perf_counter() - started - paused
        return FusionResult(logits, cache, self._stats(plan, rows, loader, elapsed, paused))

    def _starting_cache(self, plan: FusionPlan, restored: KVCache | None, extra_capacity: int) -> KVCache:
        if restored is None and not plan.restored_rows:
            cache = self.model.new_cache(plan.num_rows + extra_capacity)
            cache.allocate(torch.arange(plan.num_rows, device=self.model.device))  # row r holds position r
            return cache
        if restored is None or restored.length != plan.num_rows:
            raise ValueError(f"restored: a plan with {plan.restored_rows} restored rows needs their cache, holding "
                             f"positions 0..{plan.num_rows - 1}")
        return restored

    def _stats(self, plan: FusionPlan, rows: PlanRows, loader: LayerLoader, elapsed: float,
               paused: float) -> FusionStats:
        total, computed_rows = plan.approximate_rows, rows.computed_rows
        layers = len(computed_rows)
        return FusionStats(
            method=plan.method,
            prompt_tokens=plan.num_rows,
            reused_tokens=plan.approximate_rows,
            loaded_tokens=sum(int(s.load.numel()) for s in plan.reused),
            kept_tokens=int((~torch.isin(plan.loaded_chunk_rows.to(rows.selected.device), rows.selected)).sum()),
            computed_tokens_layer0=int(plan.compute_rows.numel()),
            recompute_share=sum(c for c, _ in computed_rows) / (layers * total) if total else 0.0,
            computed_rows_mean=sum(n for _, n in computed_rows) / layers,
            bytes_loaded=loader.bytes_read,
            peak_stored_layers_held=loader.peak_layers_held,
            load_seconds=loader.read_seconds,
            prefix_load_seconds=sum(loader.read_seconds_by_key.get(s.key, 0.0) for s in plan.reused
                                    if not s.approximate),
            load_wait_seconds=loader.wait_seconds,
            loads_overlapped=loader.threaded,
            prefill_seconds=elapsed,
            paused_seconds=paused,
            deviation_checks=rows.checks,
        )


@dataclass
class DeviationCheck:
    """What a narrowing layer measured: the recomputed rows' KV deviation from the stored KV, relative to the
    stored KV's energy on those rows (`mass`), and the part of it left on the rows it stopped recomputing
    (`residual`): the request's own signal of how far its reuse strays from a full prefill."""

    layer: int
    mass: float
    residual: float
    kept: int  # approximate rows still recomputed after it


def question_attention(model: LayerwiseModel, layer: int, q: torch.Tensor, selected: torch.Tensor,
                       k: torch.Tensor, approximate: torch.Tensor) -> torch.Tensor:
    """Per selected row, [len(selected)]: the attention the question (the rows after the last reused chunk row)
    pays it over the selected rows' recomputed keys, averaged over heads and question rows."""
    last_chunk_row = int(approximate.nonzero().max()) if approximate.any() else -1
    question = selected > last_chunk_row
    attention = model.attention_weights(layer, q[question], selected[question], k, selected).mean((0, 1))
    # A floor, so that no row's deviation is ignored outright (a sliding window or an underflow gives it zero
    # attention here): a guard of 0 still recomputes every row.
    return attention.clamp_min(1e-6)


def most_deviating(narrowing: Narrowing, approximate_rows: int, cache: KVCache, selected: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, narrowable: torch.Tensor, weights: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, DeviationCheck]:
    """Indices into `selected` to keep (order preserved): every row that is not narrowable, plus the narrowable
    rows whose recomputed K and V are furthest (L2) from the stored ones: the `keep` share of the plan's
    approximate rows, and more while the dropped rows' deviation exceeds `max_residual`. With `weights` (per
    selected row), each row's deviation and stored energy count in proportion to its weight."""
    layer = narrowing.layer
    stored_k, stored_v = cache.keys[layer][selected][narrowable], cache.values[layer][selected][narrowable]
    deviation = torch.zeros(selected.numel())
    # in fp32: a bf16 sum loses the low bits that order rows near the selection's boundary
    deviation[narrowable] = ((k[narrowable].float() - stored_k.float()).square().sum((1, 2))
                             + (v[narrowable].float() - stored_v.float()).square().sum((1, 2)))
    row_energy = stored_k.float().square().sum((1, 2)) + stored_v.float().square().sum((1, 2))
    if weights is not None:
        deviation, row_energy = deviation * weights, row_energy * weights[narrowable]
    energy = float(row_energy.sum()) or 1.0
    order = torch.where(narrowable, deviation, torch.tensor(float("inf"))).argsort(descending=True)
    fixed, candidates = int((~narrowable).sum()), int(narrowable.sum())
    budget = min(narrowing.kept_rows(approximate_rows), candidates)
    # left[j]: the deviation on the narrowable rows past the j most deviating ones
    ranked = deviation[order[fixed:]]
    left = torch.cat([ranked.flip(0).cumsum(0).flip(0), torch.zeros(1)]) / energy  # summed from the tail: exact
    # for the small rows, where total minus running sum would cancel to 0
    if narrowing.max_residual is not None:
        budget = min(max(budget, int((left > narrowing.max_residual).sum())), candidates)
    keep = order[: fixed + budget].sort().values
    return keep, DeviationCheck(layer, float(left[0]), float(left[budget]), budget)


def _as_slice(rows: torch.Tensor) -> torch.Tensor | slice:
    """Consecutive rows as a slice: the placer then rotates keys straight into the cache (`LayerwiseModel.place`),
    where a row index needs a rotated temporary and an indexed copy."""
    run = consecutive(rows)
    return rows if run is None else run
