"""vLLM's CPU cache blocks as store entries, and the connector's bookkeeping of what each step loads and saves
(all vLLM-free; the end-to-end tests in test_connector.py run vLLM itself)."""

from __future__ import annotations

import pytest
import torch

from kvreuse.integrations.vllm.pages import (
    SaveTracker,
    block_halves,
    claimable_blocks,
    entries_from_pages,
    fits,
    leading_present,
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


def saved_pages(source: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    return [cache[torch.tensor(block_ids)] for cache in source]  # what save_kv_layer copies per layer


def test_blocks_travel_byte_exact_into_other_blocks_and_leave_the_rest_alone():
    source, target = caches(0), caches(None)
    entries = entries_from_pages(["a", "b"], saved_pages(source, [4, 1]), "model", "vllm-cpu:vec:8")
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
    (entry,) = entries_from_pages(["a"], saved_pages(source, [2]), "model", "vllm-cpu:vec:8")
    assert entry.k.shape == (LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM) == entry.v.shape
    for layer in range(LAYERS):
        assert (entry.k[layer] == layer + 1).all() and (entry.v[layer] == -(layer + 1)).all()
    assert (entry.meta.num_tokens, entry.meta.compile_mode, entry.meta.dtype) == (BLOCK_SIZE, "vllm-cpu:vec:8",
                                                                                 "float32")


def test_an_entry_survives_the_store_and_still_fits():
    source = caches(1)
    (entry,) = entries_from_pages(["k1"], saved_pages(source, [5]), "model", "vllm-cpu:vec:8")
    tier = MemoryTier(10**8)
    tier.put(entry)
    target = caches(None)
    stored = tier.get("k1")
    assert fits(stored, target)
    write_entry(target, 5, stored)
    assert all(torch.equal(t[5], s[5]) for t, s in zip(target, source))


@pytest.mark.parametrize("other", ["layers", "dtype", "block_size", "heads"])
def test_an_entry_of_another_shape_or_dtype_does_not_fit(other):
    (entry,) = entries_from_pages(["a"], saved_pages(caches(0), [0]), "model", "vllm-cpu:vec:8")
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
    tracker.set_blocks("r", [10, 11], append=False)
    assert tracker.to_save("r", computed_tokens=200) is None  # block 0 was stored; block 1 is not complete yet
    first = tracker.to_save("r", computed_tokens=256)
    assert (first.block_ids, first.keys) == ([11], ["k1"])
    tracker.set_blocks("r", [12, 13], append=True)
    second = tracker.to_save("r", computed_tokens=530)
    assert (second.block_ids, second.keys) == ([12, 13], ["k2", "k3"])
    assert len(tracker) == 0  # every full block was sent: the request is forgotten
    assert tracker.to_save("r", computed_tokens=600) is None


def test_a_resumed_request_saves_into_its_new_blocks():
    tracker = SaveTracker(block_size=128)
    tracker.start("r", ["k0", "k1"], stored=0)
    tracker.set_blocks("r", [1, 2], append=False)
    assert tracker.to_save("r", computed_tokens=130).block_ids == [1]
    tracker.set_blocks("r", [7, 8], append=False)  # preempted, then resumed with blocks anew
    assert tracker.to_save("r", computed_tokens=300).block_ids == [8]
    tracker.start("s", ["k0"], stored=0)
    tracker.finish("s")
    assert tracker.to_save("s", computed_tokens=128) is None
