"""vLLM's CPU cache blocks as store entries, and the connector's bookkeeping of what each step loads and saves
(all vLLM-free; the end-to-end tests in test_connector.py run vLLM itself)."""

from __future__ import annotations

import pytest
import torch

from kvreuse.integrations.vllm.pages import (
    SaveTracker,
    block_halves,
    check_spans,
    claimable_blocks,
    entries_from_blocks,
    fits,
    leading_present,
    probe_layout,
    rotate_keys,
    check_exact_tiers,
    scheduler_tiers,
    unnamed_reason,
    write_entry,
)
from kvreuse.store.memory import MemoryTier

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 3, 6, 2, 8, 4


def caches(seed: int | None = 0) -> list[torch.Tensor]:
    shape = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape) for _ in range(LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(LAYERS)]


def test_blocks_travel_byte_exact_into_other_blocks_and_leave_the_rest_alone():
    source, target = caches(0), caches(None)
    entries = entries_from_blocks(["a", "b"], source, [4, 1], "model", "vllm-cpu:vec:8")
    write_entry(target, 0, entries[0])
    write_entry(target, 3, entries[1])
    for layer in range(LAYERS):
        assert torch.equal(target[layer][0], source[layer][4])
        assert torch.equal(target[layer][3], source[layer][1])
        untouched = [b for b in range(BLOCKS) if b not in (0, 3)]
        assert not target[layer][untouched].any()


def test_an_entry_holds_the_keys_half_as_k_and_the_values_half_as_v():
    source = caches(None)
    for layer, cache in enumerate(source):
        keys, values = block_halves(cache)
        keys.fill_(layer + 1)
        values.fill_(-(layer + 1))
    (entry,) = entries_from_blocks(["a"], source, [2], "model", "vllm-cpu:vec:8")
    assert entry.k.shape == (LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM) == entry.v.shape
    for layer in range(LAYERS):
        assert (entry.k[layer] == layer + 1).all() and (entry.v[layer] == -(layer + 1)).all()
    assert (entry.meta.num_tokens, entry.meta.compile_mode, entry.meta.dtype) == (BLOCK_SIZE, "vllm-cpu:vec:8",
                                                                                 "float32")


def test_an_entry_survives_the_store_and_still_fits():
    source = caches(1)
    (entry,) = entries_from_blocks(["k1"], source, [5], "model", "vllm-cpu:vec:8")
    tier = MemoryTier(10**8)
    tier.put(entry)
    target = caches(None)
    stored = tier.get("k1")
    assert fits(stored, target)
    write_entry(target, 5, stored)
    assert all(torch.equal(t[5], s[5]) for t, s in zip(target, source))


@pytest.mark.parametrize("other", ["layers", "dtype", "block_size", "heads"])
def test_an_entry_of_another_shape_or_dtype_does_not_fit(other):
    (entry,) = entries_from_blocks(["a"], caches(0), [0], "model", "vllm-cpu:vec:8")
    shape = (BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    layers, dtype = LAYERS, torch.float32
    if other == "layers":
        layers += 1
    elif other == "dtype":
        dtype = torch.bfloat16
    elif other == "block_size":
        shape = (BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_DIM)
    else:
        shape = (BLOCKS, 2 * HEADS, BLOCK_SIZE, HEAD_DIM)
    assert fits(entry, caches(None))
    assert not fits(entry, [torch.zeros(shape, dtype=dtype) for _ in range(layers)])


def test_a_cache_of_another_layout_is_refused_by_name():
    with pytest.raises(ValueError, match="num_kv_heads, block_size, 2 \\* head_dim"):
        block_halves(torch.zeros(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM))  # the GPU layout


def test_a_prefix_is_usable_up_to_its_first_gap():
    held = {"a", "b", "d"}
    assert leading_present(["a", "b", "c", "d"], held.__contains__) == 2
    assert leading_present(["x", "a"], held.__contains__) == 0
    assert leading_present(["a", "b"], held.__contains__) == 2


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 0), (128, 0), (129, 1), (512, 3), (513, 4)])
def test_a_hit_leaves_vllm_at_least_the_last_prompt_token(tokens, blocks):
    assert claimable_blocks(tokens, 128) == blocks


def test_saves_follow_chunked_prefill_and_skip_what_the_store_held():
    tracker = SaveTracker(block_size=128)
    keys = ["k0", "k1", "k2", "k3"]
    tracker.start("r", keys, stored=1)
    assert tracker.to_save("r", 200, [10, 11]) is None  # block 0 was stored; block 1 is not complete yet
    first = tracker.to_save("r", 256, [10, 11])
    assert (first.block_ids, first.keys) == ([11], ["k1"])
    second = tracker.to_save("r", 530, [10, 11, 12, 13])
    assert (second.block_ids, second.keys) == ([12, 13], ["k2", "k3"])
    assert len(tracker) == 0  # every full block was sent: the request is forgotten
    assert tracker.to_save("r", 600, [10, 11, 12, 13]) is None


def test_a_resumed_request_saves_into_its_new_blocks_and_a_finished_one_saves_nothing():
    tracker = SaveTracker(block_size=128)
    tracker.start("r", ["k0", "k1"], stored=0)
    assert tracker.to_save("r", 130, [1, 2]).block_ids == [1]
    assert tracker.to_save("r", 300, [7, 8]).block_ids == [8]  # preempted, then resumed with blocks anew
    tracker.start("s", ["k0"], stored=0)
    tracker.finish("s")
    assert tracker.to_save("s", 128, [1]) is None


def token_major_writer(k, v, key_cache, value_cache, slots):
    """The obvious layout: [block, head, slot, channel]."""
    block_size = key_cache.shape[2]
    key_cache[slots // block_size, :, slots % block_size] = k
    value_cache[slots // block_size, :, slots % block_size] = v


def channel_major_writer(k, v, key_cache, value_cache, slots):
    """Keys stored [channel, slot] inside each head's part of a block, values in slots reversed: orders a
    kernel may choose, which the probe must find without being told."""
    block_size, head_dim = key_cache.shape[2], key_cache.shape[3]
    for row, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        key_cache[block].view(-1, head_dim, block_size)[:, :, offset] = k[row]
        value_cache[block][:, block_size - 1 - offset] = v[row]


@pytest.mark.parametrize("writer", [token_major_writer, channel_major_writer])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_tokens_go_where_the_kernel_puts_them_and_come_back(writer, dtype):
    layout = probe_layout(writer, HEADS, BLOCK_SIZE, HEAD_DIM, dtype)
    generator = torch.Generator().manual_seed(3)
    slots = torch.tensor([3 * BLOCK_SIZE + 5, 3 * BLOCK_SIZE + 6, 1 * BLOCK_SIZE + 0, 1 * BLOCK_SIZE + 7])
    k = torch.randn(len(slots), HEADS, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(len(slots), HEADS, HEAD_DIM, generator=generator).to(dtype)
    expected = torch.randn(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=generator).to(dtype)
    ours = expected.clone()
    writer(k, v, *block_halves(expected), slots)
    layout.write(ours, slots, k, v)
    assert torch.equal(ours, expected)
    # a request whose blocks are [3, 1]: its tokens 5, 6, 8 and 15 are the rows written above
    read_k, read_v = layout.read(ours, [3, 1], num_tokens=2 * BLOCK_SIZE)
    assert torch.equal(read_k[[5, 6, 8, 15]], k) and torch.equal(read_v[[5, 6, 8, 15]], v)


def test_a_writer_that_loses_tokens_is_refused():
    def lossy(k, v, key_cache, value_cache, slots):
        token_major_writer(k[:-1], v[:-1], key_cache, value_cache, slots[:-1])

    with pytest.raises(ValueError, match="the cache writer"):
        probe_layout(lossy, HEADS, BLOCK_SIZE, HEAD_DIM, torch.float32)


def rope_at(x: torch.Tensor, positions: torch.Tensor, inverse_frequencies: torch.Tensor) -> torch.Tensor:
    angles = positions.double()[:, None] * inverse_frequencies.double()[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = x.shape[-1] // 2
    return (x.double() * cos + torch.cat([-x[..., half:], x[..., :half]], -1).double() * sin).to(x.dtype)


def test_keys_rotated_by_p_are_the_keys_rope_puts_p_further():
    inverse_frequencies = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM * 4, 2, dtype=torch.float64) / (HEAD_DIM * 4))
    raw = torch.randn(20, HEADS, HEAD_DIM * 4, dtype=torch.float64)
    at_zero = rope_at(raw, torch.arange(20), inverse_frequencies)
    moved = rotate_keys(at_zero, 37, inverse_frequencies)
    assert torch.allclose(moved, rope_at(raw, torch.arange(37, 57), inverse_frequencies), atol=1e-12)


@pytest.mark.parametrize(("spans", "message"), [
    ([], "non-empty list"), ("0-5", "non-empty list"), ([[0, 5], [6, 9]], "must start at 5"),
    ([[1, 5]], "must start at 0"), ([[0, 0]], "end after it"), ([[0, 50]], "within the prompt's 40 tokens"),
    ([[0, 5, 7]], "is not a"), ([[0, 2.5]], "is not a")])
def test_chunk_spans_that_do_not_tile_the_prompt_are_refused_by_name(spans, message):
    with pytest.raises(ValueError, match=message):
        check_spans(spans, num_prompt_tokens=40)
    assert check_spans([[0, 5], [5, 40]], 40) == [(0, 5), (5, 40)]


def test_the_scheduler_sees_the_shared_tiers_and_a_memory_only_store_is_refused():
    assert scheduler_tiers("memory:2GB, disk:/x ,redis://127.0.0.1:6379/0") == "disk:/x,redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="only a memory tier"):
        scheduler_tiers("memory:2GB")


def test_only_requests_whose_tokens_name_their_kv_are_served():
    assert unnamed_reason([1, 2, 3], multimodal=False, lora=False) is None
    assert "embeddings" in unnamed_reason(None, multimodal=False, lora=False)
    assert "images" in unnamed_reason([1, 2, 3], multimodal=True, lora=False)
    assert "LoRA" in unnamed_reason([1, 2, 3], multimodal=False, lora=True)


def test_an_int8_tier_is_refused_the_connectors_prefixes_are_exact():
    check_exact_tiers("memory:2GB,disk:/x,redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="use a plain tier in place of 'int8:redis://127.0.0.1:6379/0'"):
        check_exact_tiers("memory:2GB,int8:redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="bad store spec"):
        check_exact_tiers("memory:2GB,disk:/x:5XB")
