"""Exact prefix restoration: find the longest stored prefix of a request, bring its KV back by loading,
computing, or both at once, compute the rest of the prompt, and hand back a cache ready for decoding.

    restorer = PrefixRestorer(model, store, key_space, block_size=256)
    restorer.store_prefix(conversation_ids)                 # or restore(..., write_back=True) after a request
    result = restorer.restore(conversation_ids + new_turn, strategy="auto")
    result.logits, result.cache, result.stats

Strategies (all exact; they differ only in speed):
  load       load every stored block (plain prefix caching)
  compute    recompute the whole prompt (no reuse)
  cake       Cake / CacheFlow token-wise: compute blocks from the front while loading blocks from the back
  layerwise  CacheFlow layer-wise: compute layers bottom-up for the whole prefix while loading top-down
  auto       layerwise below the profiled threshold L_delta of this model and tier, cake from it on
Pipeline-stage restoration runs one process per stage: see `stages.restore_stage`.

A request served by the engine restores its prefix inside its fusion plan (`split`): the restorer decides which
rows (token-wise) or layers (layer-wise) of the stored blocks are computed, from the costs per row and layer
that earlier plans measured (`learn`), and the executor's one loader reads the rest with the request's chunks.
`restore` and `restore_prefix` race the two sides' pointers instead (two_pointer): the batch scheduler, the
pipeline stages and `kvreuse bench restore` use them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Sequence

import torch

from kvreuse.fusion.executor import FusionStats
from kvreuse.fusion.plan import Block, FusionPlan, PrefixSplit
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import l_delta
from kvreuse.restore.job import Capture, HiddenSource, IOChannels, LayerAxis, PrefixJob, TokenAxis
from kvreuse.restore.units import DEFAULT_COMPUTE_RUN, Axis, Rates, UnitLog, two_pointer
from kvreuse.store.base import KVStore
from kvreuse.store.entry import EntryMeta, KVEntry, dtype_name
from kvreuse.store.keys import DEFAULT_BLOCK_SIZE, KeySpace, prefix_block_keys
from kvreuse.store.tiered import TieredStore, tier_label

# strategy -> (axis, compute side on, I/O side on)
STRATEGIES = {
    "load": (TokenAxis, False, True),
    "compute": (TokenAxis, True, False),
    "cake": (TokenAxis, True, True),
    "layerwise": (LayerAxis, True, True),
}


@dataclass
class PrefixRestoration:
    """A stored prefix brought back into a new cache of the whole prompt (row r at position r): rows
    [0, rows) hold every layer's exact KV, the later rows are for the caller to fill."""

    job: PrefixJob
    stats: dict

    @property
    def cache(self) -> KVCache:
        return self.job.cache

    @property
    def rows(self) -> int:
        return self.job.prefix_length


@dataclass
class RestoreResult:
    logits: torch.Tensor  # [vocab]: next-token logits after the last prompt token
    cache: KVCache  # the whole prompt's KV, row r at position r, ready for decoding
    stats: dict = field(default_factory=dict)


def stage_starts(num_layers: int, stages: int) -> list[int]:
    """First layer of each of `stages` contiguous, near-equal layer ranges."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    return [s * num_layers // stages for s in range(stages)]


def stage_layers(num_layers: int, stages: int) -> list[range]:
    starts = stage_starts(num_layers, stages) + [num_layers]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


# A tier whose every read pays at least this before its bytes (an HDD's seek) has each prefix block read whole: 30
# reads per block (one per layer) cost 2.5-2.8x a whole read on the emulated HDD (8 ms), against 0.76-0.78x on
# the emulated SSD (0.1 ms), where layer by layer reads overlap the compute (docs/RESTORE.md).
WHOLE_READ_LATENCY_SECONDS = 1e-3


@dataclass(frozen=True)
class StepCosts:
    """Seconds per row per layer a plan spent computing, and reading stored prefix rows from one tier, as
    measured by earlier plans (None: not measured yet)."""

    compute: float | None = None
    read: float | None = None

    def merged(self, newer: StepCosts, weight: float = 0.5) -> StepCosts:
        """A running average: `newer`'s figures weigh `weight`, these the rest."""

        def mix(old: float | None, new: float | None) -> float | None:
            return old if new is None else new if old is None else (1 - weight) * old + weight * new

        return StepCosts(mix(self.compute, newer.compute), mix(self.read, newer.read))


def computed_rows(rows: int, other_rows: int, costs: StepCosts, overlapped: bool) -> int:
    """Token-wise: how many of the first `rows` stored rows to compute beside the plan's `other_rows` computed
    rows, so that each layer's compute and its reads of the rest end together (overlapped reads), or by which
    is cheaper per row (inline reads, which cost the compute's own time). Unmeasured: load them all."""
    if costs.compute is None or costs.read is None:
        return 0
    if not overlapped:
        return 0 if costs.read <= costs.compute else rows
    balance = (rows * costs.read - other_rows * costs.compute) / (costs.compute + costs.read)
    return min(max(round(balance), 0), rows)


def computed_layers(rows: int, other_rows: int, num_layers: int, costs: StepCosts, overlapped: bool) -> int:
    """Layer-wise: how many of the bottom layers compute every stored row, so that those layers' compute ends
    when the reads of the layers above do (overlapped: the loader reads ahead), or by which is cheaper per row
    (inline). Unmeasured: load every layer."""
    if costs.compute is None or costs.read is None:
        return 0
    if not overlapped:
        return 0 if costs.read <= costs.compute else num_layers
    balance = num_layers * (rows * costs.read - other_rows * costs.compute) / (rows * (costs.compute + costs.read))
    return min(max(round(balance), 0), num_layers)


class PrefixRestorer:
    def __init__(
        self,
        model: LayerwiseModel,
        store: KVStore,
        key_space: KeySpace,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        boundary_stages: Sequence[int] = (),
        channels: IOChannels | None = None,
        compute_run: int = DEFAULT_COMPUTE_RUN,
        rates: dict[tuple[str, int], Rates | StepCosts] | None = None,
    ):
        """boundary_stages: the stage counts whose boundary activations are stored with each block, so that
        a deployment with that many pipeline stages can restore every stage at once (none by default: one
        process restores every layer from its embeddings, and each boundary adds a hidden state per token).
        compute_run: tokens' worth of work the compute side claims at a time (the I/O side claims stored
        blocks). channels and rates: the I/O channels and the learnt rates, shared by restorers of one machine
        (one per tenant's key space)."""
        if compute_run < 1:
            raise ValueError(f"compute_run must be at least 1 token, got {compute_run}")
        self.model, self.store, self.key_space, self.block_size = model, store, key_space, block_size
        self.compute_run = compute_run
        starts = {s for n in boundary_stages for s in stage_starts(model.num_layers, n)}
        self.boundary_layers = sorted(starts - {0})  # layer 0's input is the embedding: never stored
        self.channels = channels or IOChannels()
        # (axis, tier) -> Rates earlier two-pointer restorations achieved; ("step", tier) -> StepCosts earlier
        # plans measured
        self._rates = {} if rates is None else rates

    # ---- lookup ---------------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int] | torch.Tensor, partial: bool = False) -> list[str]:
        """The keys of the whole blocks of `token_ids`, and of the partial block at its end if `partial`."""
        return prefix_block_keys(_as_list(token_ids), self.block_size, space=self.key_space, partial=partial)

    def _tier_of(self, key: str) -> int | None:
        if isinstance(self.store, TieredStore):
            return self.store.locate(key)
        return 0 if self.store.contains(key) else None

    def stored_blocks(self, token_ids: Sequence[int] | torch.Tensor) -> list[tuple[str, int]]:
        """(key, tier) of the longest run of stored blocks from the start of `token_ids`."""
        found = []
        for key in self.block_keys(token_ids):
            tier = self._tier_of(key)
            if tier is None:
                break
            found.append((key, tier))
        return found

    def stored_length(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Length in tokens of the longest stored prefix of `token_ids` (whole blocks)."""
        return len(self.stored_blocks(token_ids)) * self.block_size

    def blocks_to_restore(self, token_ids: Sequence[int] | torch.Tensor, max_tokens: int | None = None
                          ) -> list[Block]:
        """The stored blocks a restoration uses, clipped so that the last prompt token is always computed. With
        `max_tokens` (an exact prefix's length), the blocks within it: its whole blocks, then the partial block
        at its end (`store_prefix` stores one: a system prompt shorter than a block is reused too)."""
        end = len(token_ids) - 1
        whole = token_ids if max_tokens is None else token_ids[: max_tokens - max_tokens % self.block_size]
        blocks = []
        for i, (key, tier) in enumerate(self.stored_blocks(whole)):
            start = i * self.block_size
            if start >= end:
                break
            blocks.append(Block(i, key, slice(start, min(start + self.block_size, end)), tier, self.block_size))
        start = len(blocks) * self.block_size
        if max_tokens is not None and start == len(whole) < max_tokens and start < end:
            key = self.block_keys(token_ids[:max_tokens], partial=True)[-1]
            tier = self._tier_of(key)
            if tier is not None:
                blocks.append(Block(len(blocks), key, slice(start, min(max_tokens, end)), tier, max_tokens - start))
        return blocks

    # ---- restoration inside a fusion plan ---------------------------------------------------------------

    def split(self, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto", *, max_tokens: int | None = None,
              lost: Collection[str] = (), other_rows: int = 0) -> PrefixSplit:
        """How the longest stored prefix of `token_ids` (whole blocks within `max_tokens`, never the last token)
        comes back inside the request's plan, beside `other_rows` rows the plan computes anyway: which of its
        rows (cake) or layers (layerwise) are computed, the rest loaded by the plan's loader. Blocks in `lost`
        (found unreadable during this request) are computed."""
        blocks = self.blocks_to_restore(token_ids, max_tokens)
        strategy = self.strategy_for(strategy, blocks)
        rows = blocks[-1].rows.stop if blocks else 0
        costs, overlapped = self.step_costs(blocks), self.reads_wait(blocks)
        lost = frozenset(lost) & {b.key for b in blocks}
        whole = self.read_latency(blocks) >= WHOLE_READ_LATENCY_SECONDS
        if strategy == "compute":
            return PrefixSplit(strategy, blocks, lost, computed_rows=rows)
        if strategy == "cake":
            # Blocks read whole arrive before the first layer computes: computing some rows overlaps nothing.
            split_rows = computed_rows(rows, other_rows, costs, overlapped and not whole)
            return PrefixSplit(strategy, blocks, lost, split_rows, read_whole=whole)
        if strategy == "layerwise":
            layers = computed_layers(rows, other_rows, self.model.num_layers, costs, overlapped)
            return PrefixSplit(strategy, blocks, lost, computed_layers=layers, read_whole=whole)
        return PrefixSplit(strategy, blocks, lost, read_whole=whole)

    def _tiers(self, blocks: list[Block]) -> list[KVStore]:
        tiers = self.store.tiers if isinstance(self.store, TieredStore) else [self.store]
        return [tiers[b.tier] for b in blocks]

    def read_latency(self, blocks: list[Block]) -> float:
        """The largest latency a read of these blocks pays before its bytes."""
        return max((tier.read_latency_seconds for tier in self._tiers(blocks)), default=0.0)

    def reads_wait(self, blocks: list[Block]) -> bool:
        """Whether reading these blocks waits on a device or the network (so it overlaps the plan's compute)."""
        return any(tier.reads_wait for tier in self._tiers(blocks))

    @staticmethod
    def _step_key(blocks: list[Block]) -> tuple[str, int]:
        """Where the costs of a split of these blocks are kept: by the slowest tier among them."""
        return "step", max((b.tier for b in blocks), default=-1)

    def step_costs(self, blocks: list[Block]) -> StepCosts:
        """What earlier plans measured for stored prefix rows on the slowest of these blocks' tiers."""
        return self._rates.get(self._step_key(blocks), StepCosts())

    def learn(self, split: PrefixSplit, plan: FusionPlan, stats: FusionStats) -> None:
        """Fold what the plan that ran `split` measured into the costs the next splits are decided by: its
        compute per row and layer (reads that did not overlap taken out), and its reads of the prefix's rows."""
        layers = self.model.num_layers
        inline_reads = stats.load_wait_seconds if stats.loads_overlapped else stats.load_seconds
        computed = stats.computed_rows_mean * layers
        read = sum(int(s.load.numel()) * (layers - s.from_layer) for s in plan.reused if not s.approximate)
        measured = StepCosts(max(stats.prefill_seconds - inline_reads, 0.0) / computed if computed else None,
                             stats.prefix_load_seconds / read if read else None)
        key = self._step_key(split.blocks)
        self._rates[key] = self._rates.get(key, StepCosts()).merged(measured)

    def strategy_for(self, strategy: str, blocks: list[Block]) -> str:
        """The strategy these blocks are restored with: `strategy` itself, or for auto, layerwise below the
        profiled L_delta of the slowest tier among them and cake from it on (compute when nothing is stored)."""
        if strategy != "auto":
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}: expected auto, {', '.join(STRATEGIES)}"
                                 " (stages: see kvreuse.restore.stages)")
            return strategy
        if not blocks:
            return "compute"
        tier = max(b.tier for b in blocks)
        threshold = l_delta.threshold(self.key_space.model_fingerprint, tier_label(self.store, tier))
        prefix = blocks[-1].rows.stop
        return "layerwise" if threshold is not None and prefix < threshold else "cake"

    # ---- restoration by two pointers ------------------------------------------------------------------

    def new_job(self, token_ids: torch.Tensor, blocks: list[Block], cache_capacity: int | None = None, *,
                layers: range | None = None, hidden_in: HiddenSource | None = None) -> PrefixJob:
        cache = self.model.new_cache(max(cache_capacity or 0, len(token_ids)))
        cache.allocate(torch.arange(len(token_ids), device=self.model.device))  # row r holds position r
        return PrefixJob(self.model, self.store, token_ids, blocks, cache, channels=self.channels,
                         layers=layers or range(self.model.num_layers), hidden_in=hidden_in)

    @torch.inference_mode()
    def restore_prefix(self, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto",
                       cache_capacity: int | None = None, *, max_tokens: int | None = None) -> PrefixRestoration:
        """Bring back the longest stored prefix of `token_ids` (whole blocks within `max_tokens`, never the
        last token) into a new cache for the whole prompt; the rows after it are left to the caller."""
        started = time.perf_counter()
        ids = as_ids(token_ids, self.model.device)
        blocks = self.blocks_to_restore(ids, max_tokens)
        strategy = self.strategy_for(strategy, blocks)
        job = self.new_job(ids, blocks, cache_capacity)
        axis, log = self.run_strategy(strategy, job)
        return PrefixRestoration(job, restore_stats(strategy, job, axis, log, restore=time.perf_counter() - started))

    @torch.inference_mode()
    def restore(self, token_ids: Sequence[int] | torch.Tensor, strategy: str = "auto",
                cache_capacity: int | None = None, *, write_back: bool = False,
                with_tail: bool = False) -> RestoreResult:
        """Restore the stored prefix of `token_ids` and compute the rest; the last token is always computed.

        write_back: store the prompt's whole blocks that were not stored (computed here anyway); with_tail: and
        the partial block at its end (where `token_ids` end as an exact prefix does, not with a question)."""
        started = time.perf_counter()
        restoration = self.restore_prefix(token_ids, strategy, cache_capacity)
        job = restoration.job
        ids = job.token_ids
        capture = Capture(boundary_layers=self.boundary_layers) if write_back else None
        remainder = slice(job.prefix_length, len(ids))
        hidden = job.compute_rows(remainder, capture)
        logits = self.model.logits(hidden[-1:])[0]
        done = time.perf_counter()
        written = self._write_back(ids, remainder, capture, with_tail) if capture else 0
        stats = dict(restoration.stats, total_seconds=done - started, blocks_written=written)
        return RestoreResult(logits, job.cache, stats)

    def run_strategy(self, strategy: str, job: PrefixJob) -> tuple[Axis, UnitLog]:
        """Bring `job`'s prefix into its cache with `strategy` (not auto); returns the axis it ran along."""
        axis_type, compute, load = STRATEGIES[strategy]
        axis = axis_type(job)
        log = two_pointer(axis, compute=compute, load=load, compute_run=self.compute_run,
                          prior=self.prior_rates(axis, job))
        if compute and load:
            # Only the two-pointer strategies are priced by these rates, and only theirs are the right ones:
            # compute-only's covers the back of the prefix too, whose rows attend over more keys, while a
            # two-pointer restoration only ever computes the front.
            self.remember_rates(axis, job, log.rates)
        return axis, log

    def _rates_key(self, axis: Axis, job: PrefixJob) -> tuple[str, int]:
        return type(axis).__name__, max((b.tier for b in job.blocks), default=-1)

    def prior_rates(self, axis: Axis, job: PrefixJob) -> Rates:
        """The compute and load rates earlier restorations along this axis from this tier achieved."""
        return self._rates.get(self._rates_key(axis, job), Rates())

    def remember_rates(self, axis: Axis, job: PrefixJob, rates: Rates) -> None:
        old = self.prior_rates(axis, job)
        self._rates[self._rates_key(axis, job)] = rates.merged_over(old)

    # ---- storing --------------------------------------------------------------------------------------

    def store_prefix(self, token_ids: Sequence[int] | torch.Tensor) -> int:
        """Store each block of the exact prefix `token_ids` the store lacks (its whole blocks and the partial one
        at its end), with its boundary activations: the stored prefix is loaded, the rest computed. Returns how
        many blocks were written, once they are readable (a tiered store queues its writes)."""
        written = self.restore(token_ids, "load", write_back=True, with_tail=True).stats["blocks_written"]
        if isinstance(self.store, TieredStore):
            self.store.flush()
        return written

    def _write_back(self, ids: torch.Tensor, rows: slice, capture: Capture, with_tail: bool) -> int:
        """Put the whole blocks inside `rows` (whose KV and boundaries `capture` holds) that are not stored, and
        `with_tail` the partial block that ends them."""
        keys = self.block_keys(ids, partial=with_tail)
        k, v = capture.stacked()  # [layers, rows, heads, dim]
        boundary = torch.stack(capture.boundary) if capture.boundary else None
        written = 0
        for index in range(-(-rows.start // self.block_size), len(keys)):
            start, stop = index * self.block_size, min((index + 1) * self.block_size, rows.stop)
            if self._tier_of(keys[index]) is not None:
                continue
            local = slice(start - rows.start, stop - rows.start)
            self.store.put(self._entry(keys[index], k[:, local], v[:, local],
                                       None if boundary is None else boundary[:, local]))
            written += 1
        return written

    def _entry(self, key: str, k: torch.Tensor, v: torch.Tensor, boundary: torch.Tensor | None) -> KVEntry:
        meta = EntryMeta(self.key_space.model_fingerprint, dtype_name(k.dtype), k.shape[0], k.shape[1],
                         self.key_space.compile_mode, boundary=None if boundary is None else boundary.cpu(),
                         boundary_layers=list(self.boundary_layers) if boundary is not None else [])
        return KVEntry(key, k.cpu().contiguous(), v.cpu().contiguous(), meta)


def restore_stats(strategy: str, job: PrefixJob, axis: Axis, log: UnitLog, **seconds: float) -> dict:
    summary = log.summary(axis)
    for side in ("tokens_computed_by_tier", "tokens_loaded_by_tier"):
        summary[side] = {tier_label(job.store, tier): tokens for tier, tokens in summary[side].items()}
    return {
        "strategy": strategy,
        "prompt_tokens": len(job.token_ids),
        "prefix_tokens": job.prefix_length,
        "bytes_loaded": job.bytes_loaded,
        **summary,
        **{f"{name}_seconds": value for name, value in seconds.items()},
    }


def _as_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)


def as_ids(token_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids as a 1-D long tensor on `device` (what every restoration takes)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
    return ids
