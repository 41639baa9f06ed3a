"""The KV pool: caches adopted into its slots decode together in one attention call per layer, exactly as they
decode alone; slots are freed, reused and grown without one sequence reading another's rows."""

from __future__ import annotations

import pytest
import torch

from kvreuse.model.attention import attend_one_each, attention_mask, one_each_mask
from kvreuse.model.kv_pool import CAPACITY_STEP, KVPool
from tests.conftest import out_of_memory_after, random_ids

GIB = 1 << 30


def pool_of(model, slots: int, max_bytes: int = GIB) -> KVPool:
    return KVPool.for_model(model, slots, max_bytes)


def assert_decodes_alike(model, alone, pooled, steps: int) -> None:
    """Greedy steps of the unpooled caches one by one against the pooled ones as one batch."""
    tokens = [int(t) for t in torch.randint(3, 200, (len(alone),), generator=torch.Generator().manual_seed(1))]
    for _ in range(steps):
        expected = torch.stack([model.decode(t, cache) for t, cache in zip(tokens, alone)])
        together = model.decode_batch(tokens, pooled)
        torch.testing.assert_close(together, expected, atol=1e-4, rtol=0)
        tokens = expected.argmax(-1).tolist()
    for a, b in zip(alone, pooled):
        torch.testing.assert_close(b.positions, a.positions, atol=0, rtol=0)
        for layer in range(model.num_layers):
            torch.testing.assert_close(b.layer(layer)[0], a.layer(layer)[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(b.layer(layer)[1], a.layer(layer)[1], atol=1e-4, rtol=0)


def test_pooled_caches_decode_as_they_do_alone(tiny_model):
    # Lengths past the tiny models' sliding windows (24), so windowed layers mask by window in the pooled call.
    prompts = [random_ids(n, seed=n) for n in (5, 40, 17)]
    alone = [tiny_model.prefill(p).cache for p in prompts]
    pool = pool_of(tiny_model, slots=4)
    pooled = [pool.adopt(tiny_model.prefill(p).cache, capacity=len(p) + 8) for p in prompts]
    assert [c.slot for c in pooled] == [0, 1, 2]
    assert_decodes_alike(tiny_model, alone, pooled, steps=6)


def test_a_decoding_step_builds_the_pool_s_view_of_it_once_for_all_its_layers(tiny_model, monkeypatch):
    """The slots, rows, lengths and masks of a step are the same at every layer; a new step builds them anew (the
    steps decoding alike above fail if an old step's view is reused)."""
    pool = pool_of(tiny_model, slots=3)
    pooled = [pool.adopt(tiny_model.prefill(random_ids(n, seed=n)).cache, capacity=40) for n in (6, 11)]
    built = []
    step_of = pool.step_of
    monkeypatch.setattr(pool, "step_of", lambda *a: built.append(step_of(*a)) or built[-1])
    for _ in range(3):
        tiny_model.decode_batch([7, 8], pooled)
    assert len(built) == 3 and [int(step.lengths.max()) for step in built] == [12, 13, 14]


def test_only_caches_filling_their_span_in_slot_order_skip_the_scatter_of_queries(tiny_model):
    pool = pool_of(tiny_model, slots=4)
    pooled = [pool.adopt(tiny_model.prefill(random_ids(n, seed=n)).cache, capacity=40) for n in (6, 11, 9)]

    def step(caches):
        return pool.step_of(caches, torch.tensor([c.length for c in caches]), torch.tensor([c.length for c in caches]))

    assert step(pooled).in_order
    assert not step(pooled[::-1]).in_order  # another order: outputs go back to the batch's
    assert not step([pooled[0], pooled[2]]).in_order  # a hole in the span


def test_a_slot_taken_again_hides_the_longer_sequence_it_held(tiny_model):
    """The rows a released sequence wrote past the new one's length are still in the slot: only the length mask
    keeps them out."""
    pool = pool_of(tiny_model, slots=3)
    first = [pool.adopt(tiny_model.prefill(random_ids(n, seed=n)).cache, capacity=64) for n in (30, 50, 12)]
    pool.release(first[1])
    assert first[1].length == 0 and first[1].pool is None  # a stale reference reads nothing
    short = random_ids(9, seed=99)
    alone = [tiny_model.prefill(random_ids(n, seed=n)).cache for n in (30, 12)] + [tiny_model.prefill(short).cache]
    taken = pool.adopt(tiny_model.prefill(short).cache, capacity=20)
    assert taken.slot == 1
    assert_decodes_alike(tiny_model, alone, [first[0], first[2], taken], steps=3)


def test_sequences_spread_over_slots_with_a_hole_between_them(tiny_model):
    pool = pool_of(tiny_model, slots=4)
    prompts = [random_ids(n, seed=n) for n in (11, 21, 31)]
    pooled = [pool.adopt(tiny_model.prefill(p).cache, capacity=40) for p in prompts]
    pool.release(pooled[1])
    alone = [tiny_model.prefill(prompts[i]).cache for i in (2, 0)]
    assert_decodes_alike(tiny_model, alone, [pooled[2], pooled[0]], steps=3)  # order of the batch not of slots


def test_a_member_outgrowing_the_pool_grows_every_slot_in_place(tiny_model):
    pool = pool_of(tiny_model, slots=2)
    prompts = [random_ids(CAPACITY_STEP - 2, seed=3), random_ids(20, seed=4)]
    pooled = [pool.adopt(tiny_model.prefill(p).cache, capacity=len(p)) for p in prompts]
    assert pool.capacity == CAPACITY_STEP
    alone = [tiny_model.prefill(p).cache for p in prompts]
    assert_decodes_alike(tiny_model, alone, pooled, steps=4)
    assert pool.capacity == 2 * CAPACITY_STEP and pooled[0].length == CAPACITY_STEP + 2


def test_a_pooled_cache_takes_a_prompt_and_placed_kv_as_a_cache_of_its_own_does(tiny_model):
    """A cache in a pool's slot is a KVCache like any other: a next turn's prompt prefilled into it, and stored KV
    placed into it, give what they give in a cache of its own (torch's kernels run them where the native ones, which
    read rows of contiguous heads, do not take a slot's head-major rows)."""
    prompt = random_ids(30, seed=8)
    own = tiny_model.prefill(prompt[:12]).cache
    pool = pool_of(tiny_model, slots=2)
    pooled = pool.adopt(tiny_model.prefill(prompt[:12]).cache, capacity=40)
    expected = tiny_model.prefill(prompt[12:], cache=own)
    torch.testing.assert_close(tiny_model.prefill(prompt[12:], cache=pooled).logits, expected.logits, atol=1e-4, rtol=0)
    stored = tiny_model.prefill(prompt[:12], capture_kv=True)
    placed = pool.adopt(tiny_model.new_cache(12), capacity=12)
    rows = placed.allocate(torch.arange(12))
    for layer in range(tiny_model.num_layers):
        tiny_model.place(placed, layer, rows, stored.keys[layer], stored.values[layer], tiny_model.rotary(range(12)))
        for got, want in zip(placed.layer(layer), stored.cache.layer(layer)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_clone_of_a_pooled_cache_is_laid_out_as_a_cache_of_its_own(tiny_model):
    """Outside the pool, its rows of contiguous heads are what the native kernels read."""
    pooled = pool_of(tiny_model, slots=2).adopt(tiny_model.prefill(random_ids(12, seed=9)).cache, capacity=16)
    copy = pooled.clone()
    assert copy.pool is None and all(t.is_contiguous() for t in copy.keys + copy.values)
    for layer in range(tiny_model.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(copy.layer(layer), pooled.layer(layer)))


def layouts(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(t.shape, t.stride(), t.dtype) for t in tensors]


def test_growing_by_doubling_stops_at_the_models_window(tiny_model):
    """Rows past the window are rows no sequence reaches: doubling 768 would allocate 1536 of a 1024-row window
    (zeroed, and kept for the server's life)."""
    window = tiny_model.config.max_position_embeddings
    pool = pool_of(tiny_model, 2)
    pool.grow(3 * CAPACITY_STEP)
    pool.grow(3 * CAPACITY_STEP + 1)
    assert pool.capacity == window == 4 * CAPACITY_STEP
    assert pool.keys[0].shape[2] == window


def test_a_growth_that_fails_part_way_leaves_the_pool_as_it_was(tiny_model, monkeypatch):
    """Memory running out as the values are allocated, after the keys, must not leave grown keys beside old values:
    the next pooled decoding step would read the values by the keys' layout, past their end."""
    pool = pool_of(tiny_model, slots=2)
    prompts = [random_ids(n, seed=n) for n in (12, 20)]
    pooled = [pool.adopt(tiny_model.prefill(p).cache, capacity=32) for p in prompts]
    before = layouts(pool.keys + pool.values + [pool.positions]), pool.capacity
    monkeypatch.setattr(KVPool, "_grown", out_of_memory_after(KVPool._grown, lambda pool: pool.num_layers))
    with pytest.raises(RuntimeError, match="not enough memory"):
        pool.grow(4 * CAPACITY_STEP)
    monkeypatch.undo()
    assert (layouts(pool.keys + pool.values + [pool.positions]), pool.capacity) == before
    alone = [tiny_model.prefill(p).cache for p in prompts]
    assert_decodes_alike(tiny_model, alone, pooled, steps=2)


def test_a_pool_grown_in_a_decoding_step_takes_caches_outside_inference_mode(tiny_model):
    """decode_batch runs under torch.inference_mode: a pool it grows holds normal tensors all the same, which adopt
    (and a member's writes) outside inference mode update in place."""
    pool = pool_of(tiny_model, slots=2)
    prompt = random_ids(CAPACITY_STEP - 1, seed=10)
    first = pool.adopt(tiny_model.prefill(prompt).cache, capacity=len(prompt))
    for token in (5, 6):  # the second outgrows the pool
        tiny_model.decode(token, first)
    assert pool.capacity == 2 * CAPACITY_STEP
    assert not any(t.is_inference() for t in pool.keys + pool.values + [pool.positions])
    assert pool.adopt(tiny_model.prefill(random_ids(20, seed=11)).cache, capacity=32) is not None


def test_a_cache_the_pool_cannot_hold_is_refused(tiny_model):
    one_step = KVPool.for_model(tiny_model, 2, 1).bytes_for(CAPACITY_STEP)
    pool = pool_of(tiny_model, slots=2, max_bytes=one_step)
    cache = tiny_model.prefill(random_ids(10, seed=5)).cache
    assert pool.adopt(cache, capacity=CAPACITY_STEP + 1) is None  # over max_bytes
    assert pool.adopt(cache, capacity=16) is not None and pool.adopt(cache, capacity=16) is not None
    assert pool.adopt(cache, capacity=16) is None  # every slot taken
    with pytest.raises(ValueError, match="not a member"):
        pool.release(cache)


def test_adopting_leaves_the_original_cache_as_it_was(tiny_model):
    cache = tiny_model.prefill(random_ids(12, seed=6)).cache
    keys = cache.layer(0)[0].clone()
    pooled = pool_of(tiny_model, slots=1).adopt(cache, capacity=16)
    tiny_model.decode(7, pooled)
    assert cache.length == 12 and torch.equal(cache.layer(0)[0], keys)
    assert pooled.length == 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_one_query_each_matches_a_dense_reference(dtype, window):
    generator = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, dim, rows = 3, 6, 2, 8, 12
    q = torch.randn(batch, q_heads, dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, rows, dim, generator=generator) for _ in range(2))
    lengths = torch.tensor([12, 4, 9])
    k_pos = torch.stack([torch.randperm(rows, generator=generator) for _ in range(batch)]) + 3
    # each query at the median of its sequence's key positions: some keys later (hidden), some beyond the window
    q_pos = torch.stack([k_pos[b, : int(n)].median() for b, n in enumerate(lengths)])
    mask = one_each_mask(q_pos, k_pos, lengths, window, dtype)
    out = attend_one_each(q.to(dtype), keys.to(dtype), values.to(dtype), mask, 0.3)
    for b in range(batch):
        n = int(lengths[b])
        allowed = attention_mask(q_pos[b : b + 1], k_pos[b, :n], window)[0]
        grouped_keys = keys[b, :, :n].repeat_interleave(q_heads // kv_heads, 0).double()
        grouped_values = values[b, :, :n].repeat_interleave(q_heads // kv_heads, 0).double()
        scores = torch.einsum("hd,hmd->hm", q[b].double(), grouped_keys) * 0.3
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected = torch.einsum("hm,hmd->hd", probs, grouped_values).reshape(-1)
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[b].double(), expected, atol=tolerance, rtol=0)
