"""ReuseEngine: the Python API a RAG developer uses.

    engine = ReuseEngine.load()                                   # embedded model, in-memory store
    out = engine.ask(chunks=docs, question=q, method="cacheblend:0.15")
    print(out.text, out.ttft, out.stats)                          # PrefillStats: rows loaded/recomputed, seconds

or, step by step: `request = engine.build_request(...)`, `engine.compile(request)` to warm the store ahead of
time, `engine.generate(request, method)`.

A request's exact prefix (chat header, system prompt, earlier turns) is restored inside its plan: the longest
stored run of its blocks (block-chained keys, any tier) becomes spans of the plan, whose rows or layers a
`PrefixRestorer` splits between loading and computing (Cake token-wise, CacheFlow layer-wise: strategy "auto"
picks by the profiled L_delta). Its chunks are looked up in the store; the method turns hits and misses into a
plan; one executor runs it, one loader reading the prefix's blocks and the chunks layer by layer. Requests
restored together by the batch scheduler (`prefill_batch`) run their plans on top of the restored rows instead.
Prefix blocks and chunks that missed are computed with the request and stored for next time in the background:
a request never waits for a store write, and a conversation whose history grows reuses its stored part.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

import torch

from kvreuse.controller.auto import AutoController, Choice
from kvreuse.controller.placement import NewEntry, PlacementPolicy, choose_tier
from kvreuse.controller.profile import MachineProfile, load_profile
from kvreuse.engine.generate import Generation, decode
from kvreuse.engine.sampling import SamplingParams
from kvreuse.engine.stats import AutoChoiceStats, PrefillStats, PrefixRestoreStats
from kvreuse.engine.write_back import WriteBack
from kvreuse.fusion.compile import compile_chunk
from kvreuse.fusion.executor import FusionExecutor, FusionResult, FusionStats, StoredKVMissing
from kvreuse.fusion.methods import Auto, Method, parse_method
from kvreuse.fusion.plan import Block, FusionPlan, PlacedSegment, PrefixSplit
from kvreuse.fusion.segments import Request, Segment, SegmentKind, build_request, describe, outside_vocabulary
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.loader import LoadedModel, load_model
from kvreuse.model.options import DECODE_WEIGHTS
from kvreuse.restore import STRATEGIES, PrefixRestoration, PrefixRestorer
from kvreuse.restore.batch import BatchRestorer
from kvreuse.restore.job import IOChannels
from kvreuse.restore.restorer import StepCosts
from kvreuse.store.base import KVStore
from kvreuse.store.entry import EntryMeta, KVEntry
from kvreuse.store.keys import DEFAULT_BLOCK_SIZE, KeySpace, chunk_key
from kvreuse.store.spec import DEFAULT_STORE, open_store
from kvreuse.store.tiered import Probed, TieredStore, tier_label

log = logging.getLogger(__name__)
Probes = dict[tuple[str, bool], "Probed | None"]  # (key, with extras) -> what the store said, per request
BATCH_RESTORE = ("auto", "on", "off")


@dataclass
class FusedPrefill:
    logits: torch.Tensor  # [vocab]: first-token logits
    cache: KVCache  # the request's own KV cache, ready for decoding
    ttft: float  # seconds: lookup, load and compute up to the first-token logits
    stats: PrefillStats


class ReuseEngine:
    def __init__(self, loaded: LoadedModel, store: KVStore, *, prefix_block_size: int = DEFAULT_BLOCK_SIZE,
                 prefix_strategy: str = "auto", batch_restore: str = "auto",
                 controller: AutoController | None = None, placement: PlacementPolicy | None = None):
        """prefix_block_size: tokens per stored prefix block; prefix_strategy: how a stored prefix is restored
        (auto, load, compute, cake, layerwise: see kvreuse.restore); controller: what resolves method auto
        (default: built from this machine's saved profile on first use, measuring what it lacks); placement:
        put each new chunk on the slowest tier whose reads still hide behind recompute (CacheBlend's device
        choice, kvreuse.controller.placement) instead of on every tier. batch_restore: whether `prefill_batch`
        restores waiting requests' stored prefixes together (on), one after another (off), or together only when
        some of their blocks sit on a tier whose reads wait on a device or the network (auto): where every read
        is CPU work, as from memory or a page-cached disk, restoring together measured slower on the mean and no
        faster for the last request (docs/RESULTS.md, benchmarks/batch_prefill.py)."""
        if batch_restore not in BATCH_RESTORE:
            raise ValueError(f"batch_restore: expected one of {', '.join(BATCH_RESTORE)}, got {batch_restore!r}")
        if prefix_strategy != "auto" and prefix_strategy not in STRATEGIES:
            raise ValueError(f"prefix_strategy: unknown strategy {prefix_strategy!r}; known: auto, "
                             f"{', '.join(STRATEGIES)}")
        if prefix_block_size < 1:
            raise ValueError(f"prefix_block_size: must be at least 1 token, got {prefix_block_size}")
        # The engine probes and flushes through the tiered store's interface: a bare tier is given one.
        self.loaded, self.store = loaded, store if hasattr(store, "probe") else TieredStore([store])
        self.model = loaded.runtime
        self.executor = FusionExecutor(self.model, self.store)
        self.prefix_block_size = prefix_block_size
        self._restore_channels = IOChannels()
        self._restore_rates: dict = {}
        self.prefix_strategy = prefix_strategy
        self.batch_restore = batch_restore
        self._controller = controller
        self.placement = placement
        self._closed = False
        self.write_back = WriteBack()
        # Every compile mode this engine has stored chunks in (compiles run on the write-back thread too)
        self._compile_modes, self._compile_modes_lock = {"plain"}, threading.Lock()
        self._batch_restorer: BatchRestorer | None = None
        self._warned_unstorable = False  # whether a chunk larger than every tier was logged
        profile = controller.profile if controller else load_profile(self.fingerprint, self._dtype_name)
        if profile is not None:
            self._restore_rates |= step_costs_from(profile, self.store)

    @classmethod
    def load(cls, model: str | None = None, store: str = DEFAULT_STORE, dtype: str = "float32",
             decode_weights: str = "model", **options) -> ReuseEngine:
        """decode_weights: "model" (decoding multiplies the model's weights) or "int8" (int8 copies of them,
        LayerwiseModel.decode_in_int8: an fp32 model only). options: the constructor's keyword options
        (prefix_block_size, prefix_strategy)."""
        if decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode weights {decode_weights!r} are not one of {', '.join(DECODE_WEIGHTS)}")
        loaded = load_model(model, dtype)
        if decode_weights == "int8":
            loaded.runtime.decode_in_int8()
        return cls(loaded, open_store(store, model_fingerprint=loaded.fingerprint, dtype=dtype), **options)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.loaded.fingerprint

    @property
    def controller(self) -> AutoController:
        if self._controller is None:
            from kvreuse.controller.fidelity import load_table
            from kvreuse.controller.measure import ensure_profile

            labelled = {tier_label(self.store, i): tier for i, tier in enumerate(self._tiers)}
            profile = ensure_profile(self.model, self.fingerprint, self._dtype_name, labelled)
            self._controller = AutoController(profile, load_table(self.fingerprint))
        return self._controller

    @property
    def _dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    def build_request(self, chunks: list[str], question: str, system: str | None = None,
                      history: list[dict] | None = None, salt: str | None = None) -> Request:
        """history: the conversation's earlier messages; with the system prompt they form the exact prefix.
        salt: the tenant whose store entries the request may use (see Request.salt)."""
        return build_request(self.tokenizer, chunks, question, system, history=history, salt=salt)

    # ---- store lookups and compilation ----------------------------------------------------------------

    def _key_space(self, salt: str | None, mode: str = "plain") -> KeySpace:
        return KeySpace(self.loaded.fingerprint, self.loaded.tokenizer_fingerprint, salt, mode)

    def key_of(self, request: Request, segment: Segment, method: Method) -> str:
        """The store key of `segment` of `request`, in the request's tenant."""
        # A segment stored whole at offset 0 (a chunk compiled on its own) has exact KV there: "plain".
        mode = method.compile_mode if segment.kind == SegmentKind.CHUNK else "plain"
        return chunk_key(segment.token_ids, self._key_space(request.salt, mode))

    def chunk_keys(self, token_ids: Sequence[int], salt: str | None) -> list[str]:
        """Every key a chunk of these tokens may be stored under in tenant `salt`: one per compile mode this engine
        has stored chunks in (deleting a chunk must remove all of them, not only the default mode's)."""
        with self._compile_modes_lock:
            modes = sorted(self._compile_modes)
        return [chunk_key(token_ids, self._key_space(salt, mode)) for mode in modes]

    def restorer_for(self, request: Request | None) -> PrefixRestorer:
        """The prefix restorer keyed in the request's tenant (None: no tenant); I/O channels and learnt rates are
        the machine's, shared by every tenant."""
        return PrefixRestorer(self.model, self.store, self._key_space(request.salt if request else None),
                              self.prefix_block_size, channels=self._restore_channels, rates=self._restore_rates)

    def lookup(self, request: Request, method: Method | str | None, lost: frozenset[str] | set[str] = frozenset(),
               restored: int = 0, probes: Probes | None = None, split: PrefixSplit | None = None
               ) -> list[PlacedSegment]:
        """Each segment of `request` with its store key, whether the store holds it and on which tier (keys in
        `lost` are treated as misses: entries found unreadable during this request). The exact prefix has no key
        of its own: its stored blocks come back under `split`, or its first `restored` tokens were restored
        before the plan (a batch's restoration); the rest is computed. `probes`: what this request already asked
        the store (one probe serves every candidate of method auto)."""
        self._check_open()
        method = method if isinstance(method, Method) else parse_method(method)
        keys = {i: self.key_of(request, s, method) for i, s in enumerate(request.segments)
                if s.kind == SegmentKind.CHUNK}
        found = self._probe([k for k in keys.values() if k not in lost], method.needs_ranking, probes)
        placed = []
        for i, segment in enumerate(request.segments):
            if i not in keys:
                is_leading_prefix = segment.kind == SegmentKind.PREFIX and segment.start == 0
                placed.append(PlacedSegment(segment, restored=restored if is_leading_prefix else 0,
                                            split=split if is_leading_prefix else None))
                continue
            hit = found.get(keys[i])
            if hit is not None and not self._fits(hit.meta, segment):
                hit = None
            placed.append(PlacedSegment(segment, keys[i], hit is not None, None if hit is None else hit.meta.ranking,
                                        tier=None if hit is None else hit.tier))
        return placed

    def _fits(self, meta: EntryMeta, segment: Segment) -> bool:
        """Whether a stored entry is the KV of `segment` on this model: its layers, tokens and dtype. Keys name the
        model, so only a writer's bug (or a store shared under one fingerprint by two models) stores another; such
        an entry is a miss, not a read that fails or places KV of the wrong shape."""
        return (meta.num_layers == self.model.num_layers and meta.num_tokens == len(segment.token_ids)
                and meta.dtype == self._dtype_name)

    def _probe(self, keys: list[str], with_extras: bool, probes: Probes | None) -> dict[str, Probed]:
        """The store's one walk for these keys, less what `probes` already holds (a probe with extras serves one
        without)."""
        if probes is None:
            return self.store.probe(keys, with_extras)
        asked = [k for k in keys if (k, with_extras) not in probes and (k, True) not in probes]
        found = self.store.probe(asked, with_extras) if asked else {}
        for key in asked:
            probes[key, with_extras] = found.get(key)
        return {k: hit for k in keys if (hit := probes.get((k, True), probes.get((k, with_extras)))) is not None}

    def _compile(self, segment: Segment, key: str, method: Method) -> bool:
        """Compute the chunk's entry in `method`'s compile mode and store it; False if no tier could hold it."""
        dummies = int(method.compile_mode.partition(":")[2] or 0) if segment.kind == SegmentKind.CHUNK else 0
        with self._compile_modes_lock:
            self._compile_modes.add(method.compile_mode)
        dummy_id = self.model.config.bos_token_id or 0
        entry = compile_chunk(self.model, segment.token_ids, key, self.fingerprint, dummies, dummy_id)
        if not self.store.fits(entry.nbytes):
            self._refused_for_size(entry)
            return False
        if self.placement is not None and isinstance(self.store, TieredStore) and len(self.store.tiers) > 1:
            self.store.put(entry, self._placed_tier(entry, method))
        else:
            self.store.put(entry)
        return True

    def _refused_for_size(self, entry: KVEntry) -> None:
        """A chunk larger than any tier of the store: not stored, and not compiled again for later requests (each
        would compute its entry only to have it refused). Said once: every request with the chunk would repeat it."""
        self.write_back.unstorable(entry.key)
        if not self._warned_unstorable:
            self._warned_unstorable = True
            log.warning("a chunk of %d tokens takes %.1f MB stored, more than any tier of %s holds: such chunks are "
                        "computed for each request, not stored (a larger store keeps them)", entry.meta.num_tokens,
                        entry.nbytes / 2**20, self.store.name)

    def _placed_tier(self, entry: KVEntry, method: Method) -> int:
        # The share of the entry that `method`, which it is compiled for, recomputes beside its reads: a fixed
        # ratio's, or none for a method that decides per request (a guard), so that a slow tier is chosen only
        # where its reads surely hide.
        tiers = [(tier_label(self.store, i), self.store.free_bytes(i)) for i in range(len(self.store.tiers))]
        ratio = getattr(method, "ratio", 0.0)
        placement = choose_tier(self.controller.profile, tiers, NewEntry(entry.meta.num_tokens, ratio), self.placement)
        log.debug("placed %s on tier %d: %s", entry.key, placement.tier, placement.reason)
        return placement.tier

    def compile(self, request: Request, methods: list[str] | None = None) -> int:
        """Store the exact prefix's blocks and compile every chunk of `request` that the store lacks, in each
        compile mode the methods need; returns how many entries were written. Waits until they are readable."""
        self._check_open()
        if isinstance(methods, str):
            raise TypeError(f"methods: expected a list of method names, got the text {methods!r}")
        self.check_fits(request)  # a chunk longer than the window would be stored and never read
        prefix = exact_prefix(request)
        written = self.restorer_for(request).store_prefix(prefix.token_ids) if prefix else 0
        for method in {parse_method(m).compile_mode: parse_method(m) for m in methods or [None]}.values():
            missing = {p.key: p.segment for p in self.lookup(request, method) if p.key is not None and not p.hit}
            # a chunk the request holds twice is compiled once
            written += sum(self._compile(segment, key, method) for key, segment in missing.items())
        self.store.flush()
        return written

    def _write_back(self, placed: list[PlacedSegment], method: Method) -> None:
        behind = self.write_back.behind  # before this request's own writes: one request's chunks are all written
        for p in placed:
            if p.key is not None and not p.hit:
                self.write_back.submit(p.key, partial(self._compile, p.segment, p.key, method), second_ask=behind)

    def _write_back_prefix(self, request: Request, restored: int) -> None:
        """Store the exact prefix's whole blocks past the `restored` tokens (they were just computed), or a prefix
        shorter than a block (a system prompt, a chat header) as one partial block. `store_prefix` stores the
        partial block that ends the prefix either way: its rows are computed there anyway, so a conversation
        growing turn by turn costs no more background work than its whole blocks did."""
        prefix = exact_prefix(request)
        length = len(prefix.token_ids) if prefix else 0
        whole_blocks = length // self.prefix_block_size
        if whole_blocks * self.prefix_block_size > restored or (whole_blocks == 0 and length > restored):
            restorer = self.restorer_for(request)
            # Keyed by the block that ends the prefix (its partial one where it has one): two prefixes sharing their
            # whole blocks are two writes, or the second's partial block was dropped as a duplicate of the first.
            last_key = restorer.block_keys(prefix.token_ids, partial=True)[-1]
            if whole_blocks or not self.store.contains(last_key):
                self.write_back.submit(last_key, partial(restorer.store_prefix, prefix.token_ids))

    def wait_for_write_back(self) -> None:
        self.write_back.wait()
        self.store.flush()

    # ---- requests --------------------------------------------------------------------------------------

    def check_fits(self, request: Request, extra_tokens: int = 0) -> None:
        """`request` is a Request of the model's token ids that fits its window with `extra_tokens` more (compile,
        prefill and prefill_batch ask first)."""
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a Request (build_request makes one), got {describe(request)}")
        vocab_size = self.model.config.vocab_size
        if (bad := outside_vocabulary(request.token_ids, vocab_size)) is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})")
        window = self.model.config.max_position_embeddings
        for i, chunk in enumerate(request.of_kind(SegmentKind.CHUNK)):
            if len(chunk.token_ids) > window:
                raise ValueError(f"chunks[{i}]: {len(chunk.token_ids)} tokens exceed the context window of {window}")
        if len(request) + extra_tokens > window:
            raise ValueError(
                f"prompt: {len(request)} tokens (+{extra_tokens} to generate) exceed the context window of {window}"
            )

    def split_prefix(self, request: Request, lost: frozenset[str] | set[str] = frozenset()) -> PrefixSplit | None:
        """How the stored blocks of the request's exact prefix come back inside its plan (None: no prefix)."""
        prefix = exact_prefix(request)
        if prefix is None:
            return None
        return self.restorer_for(request).split(request.token_ids, self.prefix_strategy,
                                                max_tokens=len(prefix.token_ids), lost=lost,
                                                other_rows=len(request) - len(prefix.token_ids))

    def prefill(self, request: Request, method: str | None = None, extra_capacity: int = 0) -> FusedPrefill:
        self.check_fits(request, extra_capacity)
        return self._fuse(request, method, extra_capacity, None, time.perf_counter())

    def prefill_batch(self, requests: Sequence[tuple[Request, str | None, int]]
                      ) -> Iterator[FusedPrefill | Exception]:
        """Several requests' prefills (request, method, extra capacity), as CacheFlow serves a batch: when two or
        more have a stored prefix and `batch_restore` says it pays, those prefixes are restored together
        (`BatchRestorer`: each tier's I/O channel turns to the request whose loads save the most, compute runs in
        batched steps), then each request's plan runs on top of its restored rows. Yields each request's prefill
        in order, as soon as it is ready, or the exception that stopped it; the others go on."""
        started = time.perf_counter()
        restorations: dict[int, Future] = {}
        if len(requests) > 1 and self.batch_restore != "off" and self.prefix_strategy not in ("load", "compute"):
            restorable = [i for i, (request, method, extra) in enumerate(requests)
                          if self._has_stored_prefix(request, method, extra)]
            if not self._restore_together([requests[i][0] for i in restorable]):
                restorable = []
            for i in restorable:
                request, _, extra = requests[i]
                try:
                    restorations[i] = self.batch_restorer.submit_prefix(
                        self.restorer_for(request), request.token_ids, self.prefix_strategy,
                        len(request) + extra, max_tokens=len(exact_prefix(request).token_ids))
                except Exception as e:  # it restores alone instead, reporting its own failure if it has one
                    log.warning("batch restoration refused a request: %s", e)
        for i, (request, method, extra) in enumerate(requests):
            try:
                if i not in restorations:
                    yield self.prefill(request, method, extra)
                    continue
                restoration = restorations[i].result()  # its cache holds every row of the prompt already
                yield self._fuse(request, method, extra, restoration, started, batch=len(restorations))
            except Exception as e:  # one request's failure is its own
                yield e

    def _restore_together(self, requests: list[Request]) -> bool:
        """Whether these requests' stored prefixes are restored as one batch (see batch_restore)."""
        if len(requests) < 2 or self.batch_restore == "on":
            return len(requests) > 1
        waits = {block.tier for request in requests for block in self._prefix_blocks(request)
                 if self._tiers[block.tier].reads_wait}
        log.info("%d waiting requests with stored prefixes: restored %s", len(requests),
                 f"together (tiers {sorted(waits)} wait on reads)" if waits
                 else "one after another (every read is CPU work on this store's tiers)")
        return bool(waits)

    def _has_stored_prefix(self, request: Request, method: str | None, extra_capacity: int) -> bool:
        """Whether `request` is valid, restores its exact prefix, and the store holds that prefix's first block."""
        try:
            policy = parse_method(method)
            self.check_fits(request, extra_capacity)
            return policy.restores_prefix and exact_prefix(request) is not None and bool(self._prefix_blocks(request))
        except Exception:  # its own prefill reports the error
            return False

    def _prefix_blocks(self, request: Request) -> list[Block]:
        """The stored blocks of the request's exact prefix that its restoration would use."""
        restorer = self.restorer_for(request)
        return restorer.blocks_to_restore(request.token_ids, len(exact_prefix(request).token_ids))

    @property
    def batch_restorer(self) -> BatchRestorer:
        """CacheFlow's batch-aware restorer; its workers live as long as the engine."""
        if self._batch_restorer is None:
            self._batch_restorer = BatchRestorer(self.restorer_for(None))
        return self._batch_restorer

    def _fuse(self, request: Request, method: str | None, extra_capacity: int,
              restoration: PrefixRestoration | None, started: float, batch: int = 1) -> FusedPrefill:
        """A prefill: `auto` resolved, the stored prefix split between loading and computing (unless a batch
        restored it already: `restoration`), the chunks looked up and the plan run; a stored part found
        unreadable is computed instead and the plan runs again. What missed is written back off the request's
        path."""
        policy = parse_method(method)
        restored = restoration.rows if restoration else 0
        lost: set[str] = set()
        splits = restoration is None and policy.restores_prefix
        split = self.split_prefix(request) if splits else None
        choice, probes = None, {}
        if isinstance(policy, Auto):
            choice = self.controller.choose(policy,
                                            lambda m: self.plan_on_tiers(request, m, restored, probes, split))
            policy = parse_method(choice.method)
            split = split if policy.restores_prefix else None
        while True:
            placed, plan, located = self._placed_plan(request, policy, lost, restored, probes, split)
            overlap = self._loads_wait(plan, located)
            try:
                result: FusionResult = self.executor.run(
                    plan if overlap else self._whole_reads_where_they_pay(plan, located), request.token_ids,
                    extra_capacity, restoration.cache if restoration else None, overlap_loads=overlap,
                )
                break
            except StoredKVMissing as e:  # evicted or damaged since the lookup: compute it instead
                if e.key in lost:  # the plan read it again: computing it instead did not take
                    raise RuntimeError(f"the plan read stored KV {e.key} after it was found unreadable") from e
                log.warning("%s; recomputing it", e)
                lost.add(e.key)
                split = self.split_prefix(request, lost) if split is not None else None
        span_tiers = [tier_label(self.store, i) for i in located]
        if split is not None and split.blocks:
            self.restorer_for(request).learn(split, plan, result.stats)
        self._write_back(placed, policy)
        if policy.restores_prefix:
            self._write_back_prefix(request, split.rows if split else restored)
        prefix = prefix_stats(restoration, batch) if restoration else split_stats(split, plan, result.stats, self.store,
                                                                                 self.model.num_layers)
        stats = PrefillStats(result.stats, prefix,
                             chunk_hits=sum(p.hit for p in placed if p.segment.kind == SegmentKind.CHUNK),
                             chunks=len(request.of_kind(SegmentKind.CHUNK)),
                             loaded_tokens_by_tier=loaded_tokens_by_tier(plan, span_tiers),
                             auto=auto_stats(method, choice))
        return FusedPrefill(result.logits, result.cache, time.perf_counter() - started, stats)

    def plan_on_tiers(self, request: Request, method: str, restored: int = 0, probes: Probes | None = None,
                      split: PrefixSplit | None = None) -> tuple[FusionPlan, list[str]]:
        """The method's plan for what the store holds now (the first `restored` rows restored already, or the
        stored prefix under `split`), and the tier of each reused span: what the controller's cost model
        prices."""
        policy = parse_method(method)
        _, plan, located = self._placed_plan(request, policy, set(), restored, probes,
                                             split if policy.restores_prefix else None)
        return plan, [tier_label(self.store, i) for i in located]

    def _placed_plan(self, request: Request, policy: Method, lost: set[str], restored: int, probes: Probes | None,
                     split: PrefixSplit | None) -> tuple[list[PlacedSegment], FusionPlan, list[int]]:
        """The request's segments as the store holds them now, the method's plan for them, and the index of the
        tier each reused span of the plan reads from."""
        placed = self.lookup(request, policy, lost, restored, probes, split)
        plan = policy.plan(request, placed)
        return placed, plan, span_tiers_of(plan, placed)

    @property
    def _tiers(self) -> list[KVStore]:
        """The store's tiers by index (a plan's `located`, a block's `tier`): a single store is its own tier 0."""
        return getattr(self.store, "tiers", [self.store])

    def _whole_reads_where_they_pay(self, plan: FusionPlan, located: list[int]) -> FusionPlan:
        """`plan` with its spans on tiers that read whole spans best (`reads_whole_spans`) read every layer at once,
        for an inline run."""
        reused = [replace(span, read_whole=True) if self._tiers[i].reads_whole_spans else span
                  for span, i in zip(plan.reused, located)]
        return replace(plan, reused=reused)

    def _loads_wait(self, plan: FusionPlan, located: list[int]) -> bool:
        """Whether any of the plan's reads waits on a device or the network: only then does a loader thread
        beside the compute pay (kvreuse.fusion.executor.LayerLoader)."""
        return any(self._tiers[i].reads_wait for span, i in zip(plan.reused, located) if span.load.numel())

    def generate(self, request: Request, method: str | None = None, sampling: SamplingParams | None = None
                 ) -> Generation:
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {describe(sampling)}")
        started = time.perf_counter()
        fused = self.prefill(request, method, extra_capacity=sampling.max_tokens)
        return self.generate_after(fused, sampling, started, request)

    def generate_after(self, fused: FusedPrefill, sampling: SamplingParams, started: float, request: Request
                       ) -> Generation:
        """Decode from a prefill of `request` (its first-token logits and cache, which decoding extends);
        `started`: when the request arrived, for its TTFT."""
        generation = decode(self.loaded, fused.logits, fused.cache, sampling, started, request.token_ids)
        generation.stats = fused.stats
        return generation

    def ask(self, chunks: list[str], question: str, system: str | None = None, method: str | None = None,
            max_tokens: int = 128, history: list[dict] | None = None, salt: str | None = None) -> Generation:
        """Answer `question` over reusable `chunks` (documents), reusing whatever the store holds of them and of
        the conversation so far (`history`: earlier messages) within the tenant `salt`."""
        request = self.build_request(chunks, question, system, history, salt)
        return self.generate(request, method, SamplingParams(max_tokens=max_tokens))

    def answer_ids(self, answer: str) -> list[int]:
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        if not answer_ids:
            raise ValueError("answer: must contain at least one token")
        return answer_ids

    @torch.inference_mode()
    def teacher_forced_logprobs(self, first_logits: torch.Tensor, cache: KVCache, answer_ids: list[int]
                                ) -> torch.Tensor:
        """Log-probabilities of `answer_ids` fed one by one after a prefill (its logits and cache, extended)."""
        logits = [first_logits] + [self.model.decode(t, cache) for t in answer_ids[:-1]]
        logprobs = torch.log_softmax(torch.stack(logits).float(), dim=-1)
        return logprobs[torch.arange(len(answer_ids)), torch.tensor(answer_ids)]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ReuseEngine is closed: its store and write-back are gone")

    def close(self) -> None:
        """Finish the queued store writes and release the store; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.write_back.close()
        self.executor.close()
        if self._batch_restorer is not None:
            self._batch_restorer.close()
        self.store.close()


def step_costs_from(profile: MachineProfile, store: KVStore) -> dict[tuple[str, int], StepCosts]:
    """The prefix restorer's starting costs per tier (before any plan has measured them), from the machine
    profile the controller prices plans with: its recompute and read costs per token and layer."""
    tiers = getattr(store, "tiers", [store])
    return {("step", i): StepCosts(profile.compute.t_c, profile.t_i(label))
            for i, label in ((i, tier_label(store, i)) for i in range(len(tiers))) if label in profile.tiers}


def span_tiers_of(plan: FusionPlan, placed: list[PlacedSegment]) -> list[int]:
    """The tier serving each reused span, as the lookup's probe found it (before the run: a read promotes what
    it reads)."""
    tiers = {p.key: p.tier for p in placed if p.key is not None}
    for p in placed:
        tiers.update({block.key: block.tier for block in p.split.blocks} if p.split else {})
    return [tiers.get(span.key) or 0 for span in plan.reused]


def exact_prefix(request: Request) -> Segment | None:
    """The request's leading exact-prefix segment, if it has one."""
    first = request.segments[0]
    return first if first.kind == SegmentKind.PREFIX else None


def loaded_tokens_by_tier(plan: FusionPlan, span_tiers: list[str]) -> dict[str, int]:
    """Chunk rows read, by the tier serving them."""
    by_tier: Counter[str] = Counter()
    for span, tier in zip(plan.reused, span_tiers):
        if span.approximate and span.load.numel():
            by_tier[tier] += int(span.load.numel())
    return dict(by_tier)


def auto_stats(requested: str | None, choice: Choice | None) -> AutoChoiceStats | None:
    """What method auto chose, and the TTFT the cost model predicted for it (`kvreuse bench fusion` sets it
    beside the measured one)."""
    if choice is None:
        return None
    return AutoChoiceStats(requested, choice.predicted_seconds,
                           {c.method: c.prediction.seconds for c in choice.candidates})


def prefix_stats(restoration: PrefixRestoration | None, batch: int = 1) -> PrefixRestoreStats:
    if restoration is None:
        return PrefixRestoreStats()
    stats = restoration.stats
    return PrefixRestoreStats(stats["strategy"], restoration.rows, stats["tokens_loaded_by_tier"],
                              stats["tokens_computed_by_tier"], stats["restore_seconds"], batch)


def split_stats(split: PrefixSplit | None, plan: FusionPlan, stats: FusionStats, store: KVStore, layers: int
                ) -> PrefixRestoreStats:
    """How the prefix's stored blocks came back inside the plan: rows loaded (in whole-token equivalents, for a
    layer-wise split) and computed, by the tier each block was stored on."""
    if split is None or not split.blocks:
        return PrefixRestoreStats()
    loaded: Counter[str] = Counter()
    for span in plan.reused:
        if not span.approximate:
            loaded[span.key] += span.load.numel() * (layers - span.from_layer) / layers
    by_tier: dict[str, list[float]] = {}
    for block in split.blocks:
        tier = by_tier.setdefault(tier_label(store, block.tier), [0.0, 0.0])
        tier[0] += loaded[block.key]
        tier[1] += block.length - loaded[block.key]
    return PrefixRestoreStats(split.strategy, split.rows,
                              {t: round(n) for t, (n, _) in by_tier.items() if round(n)},
                              {t: round(n) for t, (_, n) in by_tier.items() if round(n)},
                              stats.prefix_load_seconds, batch=1)
