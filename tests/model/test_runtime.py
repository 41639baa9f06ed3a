"""The layer-wise runtime on tiny random-weight models of every supported family."""

import pytest
import torch

from kvreuse.model.check import (
    KEY_TILE,
    check_chunk_rerotation,
    check_greedy_generation,
    check_prefill_logits,
    core_length,
    gate_length,
    gate_prompt_ids,
    run_gate,
)
from kvreuse.model.attention import attention_mask
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.runtime import LAST_ROW, LayerwiseModel, RowGroup


@pytest.fixture(scope="module")
def prompt_ids():
    return torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()


def test_correctness_gate(tiny_model, prompt_ids):
    for result in run_gate(tiny_model, prompt_ids, eos_ids={tiny_model.config.eos_token_id}):
        assert result.passed, f"{result.name}: {result.detail}"


def test_prefill_in_pieces_equals_one_prefill(tiny_model, prompt_ids):
    whole = tiny_model.prefill(prompt_ids)
    cache = tiny_model.prefill(prompt_ids[:25]).cache
    rest = tiny_model.prefill(prompt_ids[25:], cache=cache)  # grows the cache past its first capacity
    torch.testing.assert_close(rest.logits, whole.logits, atol=1e-4, rtol=0)
    for layer in range(tiny_model.num_layers):
        torch.testing.assert_close(rest.cache.layer(layer)[0], whole.cache.layer(layer)[0], atol=1e-4, rtol=0)


@torch.inference_mode()
def test_rotary_table_rows_equal_tables_built_per_call(tiny_model):
    """The cached RoPE table, grown across calls (past its first size, 1024), gives each position what the
    model's rotary module gives for it alone, scaling included; scattered positions too."""
    for positions in (torch.arange(7), torch.tensor([1500, 3, 1024, 40]), range(2000, 2600), range(3000, 3000)):
        cached = tiny_model.rotary(positions)
        positions = torch.as_tensor(positions)
        assert cached.cos.shape[:2] == (len(tiny_model.rope_kinds), len(positions))
        for i, kind in enumerate(tiny_model.rope_kinds):
            for p in positions[[0, -1]].tolist() if len(positions) else []:
                cos, sin = tiny_model.decoder.rotary_emb(torch.empty(0), torch.tensor([[p]]),
                                                         *([] if kind is None else [kind]))
                row = int((positions == p).nonzero()[0])
                torch.testing.assert_close(cached.cos[i, row, 0], cos[0, 0], atol=0, rtol=0)
                torch.testing.assert_close(cached.sin[i, row, 0], sin[0, 0], atol=0, rtol=0)


@torch.inference_mode()
def test_the_rotary_table_is_built_once_and_doubled_as_positions_grow(tiny_model, monkeypatch):
    """A decoding step asks for the next position's row: the table must serve it, not be built again each call."""
    built = []
    build = tiny_model._rotary_of
    monkeypatch.setattr(tiny_model, "_rotary_of", lambda positions: built.append(len(positions)) or build(positions))
    tiny_model._rotary_table = None
    for position in range(500, 520):
        tiny_model.rotary(torch.tensor([position]))
    tiny_model.rotary(range(0, 1000))
    assert built == [1024]
    tiny_model.rotary(torch.tensor([1500]))
    assert built == [1024, 2048]


@pytest.mark.parametrize(("family", "rope_type"), [
    ("llama", "dynamic"),
    ("gemma3", {"full_attention": "dynamic", "sliding_attention": "default"}),  # by kind of layer
])
def test_rotary_tables_of_dynamic_rope_are_built_per_call(make_tiny, family, rope_type):
    """Dynamic scaling changes a position's angles with the longest position in the call: no shared table, whichever
    kind of layer scales so."""
    hf_model = make_tiny(family)
    hf_model.model.rotary_emb.rope_type = rope_type
    model = LayerwiseModel(hf_model)
    model.rotary(torch.arange(10))
    assert model._rotary_table is None


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 5])
def test_q_and_k_side_by_side_rotate_in_one_pass_as_each_alone(tiny_model, rows):
    """The step's q and k, views of one product, rotate as one [rows, Hq + Hkv, D] pass; the result equals each
    rotated alone, and other layouts (k before q, q beside v, separate tensors: Qwen3's and Gemma's q and k come
    out of their norms) take a pass each."""
    from kvreuse.model import runtime
    from kvreuse.model.adapters import Qwen3Adapter

    q, k, v = tiny_model.qkv(0, torch.randn(rows, tiny_model.hidden_size))
    rotary = tiny_model.rotary(torch.arange(7, 7 + rows))
    normed_apart = isinstance(tiny_model.adapter, Qwen3Adapter)
    assert (runtime._heads_side_by_side(q, k) is None) == normed_apart
    # k's memory, its heads interleaved (not rows of contiguous heads): right after q's, yet not their layout
    interleaved = k.as_strided(k.shape, (k.stride(0), 1, k.shape[1]))
    for pair in ((q, k), (k, q), (q, v), (q.clone(), k.clone()), (q, interleaved)):
        if pair[0] is not q or pair[1] is not k:
            assert runtime._heads_side_by_side(*pair) is None
        rotated = tiny_model.rope_qk(0, *pair, rotary)
        for got, alone in zip(rotated, pair):
            torch.testing.assert_close(got, tiny_model.rope(0, alone, rotary), atol=0, rtol=0)


@torch.inference_mode()
def test_logits_are_the_lm_head_s(tiny_model):
    for rows in (1, 3):
        hidden = torch.randn(rows, tiny_model.hidden_size)
        want = tiny_model.hf_model.lm_head(tiny_model.decoder.norm(hidden))
        got = tiny_model.logits(hidden)
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [slice(5, 17), torch.arange(5, 17).flip(0)])
def test_place_rotates_stored_keys_and_converts_them_to_the_model_s_dtype(tiny_model, rows):
    k = torch.randn(12, tiny_model.num_kv_heads, tiny_model.head_dim, dtype=torch.float64)
    rotary = tiny_model.rotary(torch.arange(30, 42))
    cache = tiny_model.new_cache(20)
    tiny_model.place(cache, 0, rows, k, k + 1, rotary)
    assert cache.keys[0].dtype == tiny_model.dtype
    want = tiny_model.rope(0, k.to(tiny_model.dtype), rotary)
    torch.testing.assert_close(cache.keys[0][rows], want, atol=0, rtol=0)
    torch.testing.assert_close(cache.values[0][rows], (k + 1).to(tiny_model.dtype), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [slice(5, 17), torch.arange(5, 17).flip(0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the model's dtype (native, one pass) or not
def test_place_in_parts_equals_placing_them_joined(tiny_model, rows, dtype):
    k = torch.randn(12, tiny_model.num_kv_heads, tiny_model.head_dim, dtype=dtype)
    rotary = tiny_model.rotary(torch.arange(30, 42))
    joined, in_parts = tiny_model.new_cache(20), tiny_model.new_cache(20)
    tiny_model.place(joined, 1, rows, k, k + 1, rotary)
    tiny_model.place(in_parts, 1, rows, list(k.split([3, 1, 8])), list((k + 1).split([3, 1, 8])), rotary)
    assert torch.equal(in_parts.keys[1][rows], joined.keys[1][rows])
    assert torch.equal(in_parts.values[1][rows], joined.values[1][rows])


def _spread_heads(*caches: KVCache) -> None:
    """Each layer of the caches made a view whose heads lie apart in its rows, as a pool's slot can: a cache the
    native placer does not take."""
    for cache in caches:
        cache.keys, cache.values = ([torch.zeros(t.shape[1], t.shape[0], t.shape[2]).transpose(0, 1) for t in ts]
                                    for ts in (cache.keys, cache.values))


@pytest.mark.parametrize("heads_in_rows", [True, False])  # a cache the native pass takes, or one it does not
def test_place_picking_rows_from_whole_parts_equals_placing_the_picked_rows(tiny_model, heads_in_rows):
    """A tier's layers handed out whole with the rows to pick (CacheTune's sparse rows from memory) place as the
    rows gathered first would, in the native pass and in torch's ops alike."""
    held = [torch.randn(n, tiny_model.num_kv_heads, tiny_model.head_dim) for n in (9, 3, 7)]
    picks = [torch.tensor([8, 0, 2, 3]), None, torch.tensor([6, 1])]
    keys = [t if p is None else t[p] for t, p in zip(held, picks)]
    rows, rotary = torch.arange(5, 14).flip(0), tiny_model.rotary(torch.arange(30, 39))
    gathered, picked = tiny_model.new_cache(20), tiny_model.new_cache(20)
    if not heads_in_rows:
        _spread_heads(gathered, picked)
    tiny_model.place(gathered, 1, rows, keys, [k + 1 for k in keys], rotary)
    tiny_model.place(picked, 1, rows, held, [k + 1 for k in held], rotary, picks)
    assert torch.equal(picked.keys[1][rows], gathered.keys[1][rows])
    assert torch.equal(picked.values[1][rows], gathered.values[1][rows])
    assert torch.equal(gathered.values[1][rows], torch.cat(keys) + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the model's dtype (native, one pass) or not
@pytest.mark.parametrize("heads_in_rows", [True, False])
def test_place_layers_equals_placing_each_layer_on_its_own(tiny_model, dtype, heads_in_rows):
    """A read's layers placed in one call (an inline loader's) as `place` puts each of them, in the native pass
    and in torch's ops alike (a cache it does not take, a part it converts first)."""
    layers = range(0, tiny_model.num_layers)
    held = [torch.randn(len(layers), n, tiny_model.num_kv_heads, tiny_model.head_dim, dtype=dtype) for n in (9, 3)]
    picks = [torch.tensor([8, 0, 2, 3]), None]
    rows, rotary = torch.arange(5, 12).flip(0), tiny_model.rotary(torch.arange(30, 37))
    together, alone = tiny_model.new_cache(20), tiny_model.new_cache(20)
    if not heads_in_rows:
        _spread_heads(together, alone)
    tiny_model.place_layers(together, layers, rows, held, [k + 1 for k in held], rotary, picks)
    for i, layer in enumerate(layers):
        tiny_model.place(alone, layer, rows, [k[i] for k in held], [k[i] + 1 for k in held], rotary, picks)
        assert torch.equal(together.keys[layer][rows], alone.keys[layer][rows]), layer
        assert torch.equal(together.values[layer][rows], alone.values[layer][rows]), layer
    assert not torch.equal(together.values[0][rows], together.values[1][rows])


@torch.inference_mode()
def test_scattered_query_rows_see_only_earlier_positions(tiny_model, prompt_ids):
    """Recompute a scattered, shuffled subset of rows against the full K/V: each must equal the full prefill's
    row. A bottom-right-aligned mask (CacheBlend's public code) would let early rows see later keys."""
    model, n = tiny_model, len(prompt_ids)
    full = model.prefill(prompt_ids)
    positions = torch.arange(n)
    rotary = model.rotary(positions)
    hidden = model.embed(torch.tensor(prompt_ids))
    rows = torch.tensor([41, 3, 17, 59, 0, 30])
    keys, values = full.cache.layer(0)
    q, _, _ = model.qkv(0, hidden[rows])
    q = model.rope(0, q, model.rotary(positions[rows]))
    subset = model.attend(0, q, positions[rows], keys, values, full.cache.positions)

    q_all, _, _ = model.qkv(0, hidden)
    everything = model.attend(0, model.rope(0, q_all, rotary), positions, keys, values, positions)
    torch.testing.assert_close(subset, everything[rows], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_few_sorted_query_rows_attend_in_groups_exactly(tiny_model):
    """Sorted scattered rows, fewer than half the prompt: the grouped path (each group of queries attends only
    the keys up to its last position, or its window) must equal one masked attention over every key."""
    model = tiny_model
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(2))
    full = model.prefill(ids)
    positions = torch.arange(ids.numel())
    # 70 rows: several groups, and fewer than half the prompt (more would take the padded causal path)
    rows = torch.randperm(ids.numel() - 1, generator=torch.Generator().manual_seed(3))[:70].sort().values
    hidden = model.embed(ids[rows])
    for layer in range(model.num_layers):
        keys, values = full.cache.layer(layer)
        q, _, _ = model.qkv(layer, hidden)
        q = model.rope(layer, q, model.rotary(rows))
        out = model.attend(layer, q, rows, keys, values, positions)
        mask = attention_mask(rows, positions, model.windows[layer])
        masked = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], attn_mask=mask,
            scale=model.layers[layer].self_attn.scaling, enable_gqa=True)[0].transpose(0, 1).flatten(1)
        torch.testing.assert_close(out, masked, atol=1e-5, rtol=0)
        hidden = model.finish_layer(layer, hidden, out)


def test_attention_mask_is_causal_by_position_and_windowed():
    q_pos = torch.tensor([5, 1])
    k_pos = torch.tensor([0, 1, 2, 5, 6])
    assert attention_mask(q_pos, k_pos, None).tolist() == [
        [True, True, True, True, False],
        [True, True, False, False, False],
    ]
    assert attention_mask(q_pos, k_pos, 4).tolist() == [
        [False, False, True, True, False],
        [True, True, False, False, False],
    ]


def test_prefill_rejects_empty_input(tiny_model):
    with pytest.raises(ValueError, match="non-empty"):
        tiny_model.prefill([])


def test_gate_catches_rope_applied_by_row_index(make_tiny, tiny_family, prompt_ids, monkeypatch):
    model = LayerwiseModel(make_tiny(tiny_family))
    rope = model.rope
    # the classic placement bug: rotating by row index, ignoring the chunk's real offset
    monkeypatch.setattr(model, "rope",
                        lambda layer, x, rotary, out=None: rope(layer, x, model.rotary(torch.arange(x.shape[0])), out))
    assert check_prefill_logits(model, prompt_ids).passed  # invisible to a plain prefill...
    assert not check_chunk_rerotation(model, prompt_ids).passed  # ...but not to placement


def test_gate_catches_a_wrong_attention_mask(make_tiny, tiny_family, prompt_ids):
    model = LayerwiseModel(make_tiny(tiny_family))
    model.windows = [2] * model.num_layers
    assert not check_prefill_logits(model, prompt_ids).passed
    assert not check_greedy_generation(model, prompt_ids, eos_ids={model.config.eos_token_id}).passed


@torch.inference_mode()
def test_attention_weights_are_what_attend_applies(tiny_model, prompt_ids):
    """The probabilities analyses read are the ones the fused kernel uses: weighting the values with them gives
    attend's output (GQA and out-of-order query rows included), and every row sums to 1."""
    model = tiny_model
    full = model.prefill(prompt_ids)
    positions = full.cache.positions
    hidden = model.embed(torch.tensor(prompt_ids))
    rows = torch.tensor([41, 3, 17, 59, 0])
    q, _, _ = model.qkv(1, hidden[rows])
    q = model.rope(1, q, model.rotary(positions[rows]))
    keys, values = full.cache.layer(1)
    weights = model.attention_weights(1, q, positions[rows], keys, positions)
    grouped = values.repeat_interleave(model.num_q_heads // model.num_kv_heads, dim=1)
    weighted = torch.einsum("hnm,mhd->nhd", weights, grouped).reshape(len(rows), -1)
    attended = model.attend(1, q, positions[rows], keys, values, positions)
    torch.testing.assert_close(weighted, attended, atol=1e-5, rtol=0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
    assert (weights[:, 1, 4:] == 0).all()  # row 1 sits at position 3: it sees positions 0..3 only


def test_batched_decode_equals_decoding_each_sequence_alone(tiny_model):
    """Sequences of different lengths (one past the sliding window) decoded together give each one's own
    logits and KV: batching shares the weight reads, never attention across sequences."""
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 31, 12)]
    alone = [tiny_model.prefill(p) for p in prompts]
    together = [tiny_model.prefill(p) for p in prompts]
    tokens = [int(r.logits.argmax()) for r in alone]
    for _ in range(4):
        expected = torch.stack([tiny_model.decode(t, r.cache) for t, r in zip(tokens, alone)])
        batched = tiny_model.decode_batch(tokens, [r.cache for r in together])
        torch.testing.assert_close(batched, expected, atol=1e-4, rtol=0)
        tokens = expected.argmax(-1).tolist()
    for a, b in zip(alone, together):
        torch.testing.assert_close(b.cache.positions, a.cache.positions, atol=0, rtol=0)
        for layer in range(tiny_model.num_layers):
            torch.testing.assert_close(b.cache.layer(layer)[0], a.cache.layer(layer)[0], atol=1e-4, rtol=0)


def test_batched_decode_needs_one_token_per_cache(tiny_model):
    with pytest.raises(ValueError, match="one token per cache"):
        tiny_model.decode_batch([5, 6], [tiny_model.prefill([3, 4]).cache])


def test_gate_prompt_runs_past_every_attention_window(tiny_model):
    def encode(text: str) -> list[int]:
        return list(range(len(text.split())))

    ids = gate_prompt_ids(tiny_model, encode, "five words of gate text")
    windows = [w for w in tiny_model.windows if w is not None]
    assert len(ids) > gate_length(tiny_model) >= core_length(tiny_model) > max([4 * KEY_TILE, *windows])


def test_a_step_s_shape_is_kept_per_thread(tiny_model):
    """A batch restoration steps different groups in several threads through one model: each thread's step keeps
    its own shape (a shared one let a thread run another's RoPE tables; tests/restore/test_batch.py hit it)."""
    import threading

    from kvreuse.model.runtime import RowGroup

    def groups_of(n: int) -> list[RowGroup]:
        positions = torch.arange(n)
        return [RowGroup(tiny_model.new_cache(n), slice(0, n), positions, tiny_model.rotary(range(n)))]

    mine, theirs = groups_of(4), groups_of(7)
    shape = tiny_model._shape_of(mine)
    other = threading.Thread(target=lambda: tiny_model._shape_of(theirs))
    other.start()
    other.join()
    assert tiny_model._shape_of(mine) is shape and shape.groups is mine and shape.rotary.cos.shape[1] == 4


@torch.inference_mode()
def test_a_prompt_s_last_layer_finishes_its_last_row_alone(tiny_model, prompt_ids, finished_rows):
    """The last layer writes every row's KV but only the last row, the one the LM head takes, goes through
    attention, the o-projection and the MLP: the logits and every layer's KV equal a step that finishes all."""
    from kvreuse.model.runtime import Straight

    cache = tiny_model.new_cache(len(prompt_ids))
    positions = torch.arange(len(prompt_ids))
    group = RowGroup(cache, cache.allocate(positions), positions, tiny_model.rotary(range(len(prompt_ids))))
    driver = Straight(tiny_model.embed(torch.tensor(prompt_ids)), [group])
    tiny_model.run_layers(range(tiny_model.num_layers), driver)
    every_row = tiny_model.logits(driver.hidden[-1:])[0]

    finished_rows.clear()
    result = tiny_model.prefill(prompt_ids)
    assert [rows for _, rows in finished_rows] == [len(prompt_ids)] * (tiny_model.num_layers - 1) + [1]
    torch.testing.assert_close(result.logits, every_row, atol=1e-4, rtol=0)
    for layer in range(tiny_model.num_layers):
        torch.testing.assert_close(result.cache.layer(layer), cache.layer(layer), atol=0, rtol=0)


@torch.inference_mode()
def test_a_group_s_outputs_are_taken_from_the_rows_it_narrowed_to(tiny_model):
    """`outputs` picks among the rows a narrowing group kept: their KV is written, the chosen ones attend."""
    n = 12
    ids = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(4))
    hidden, positions, rotary = tiny_model.embed(ids), torch.arange(n), tiny_model.rotary(range(n))
    keep = torch.tensor([1, 4, 5, 9])

    def step(outputs):
        cache = tiny_model.new_cache(n)
        cache.allocate(positions)
        for stored in (cache.keys[0], cache.values[0]):  # the rows it does not keep hold stored KV
            stored[:n] = torch.randn(stored[:n].shape, generator=torch.Generator().manual_seed(5))
        group = RowGroup(cache, positions, positions, rotary, narrow=lambda *_: keep, outputs=outputs)
        return tiny_model.step(0, hidden, [group]), cache

    narrowed, narrowed_cache = step(None)
    last, last_cache = step(LAST_ROW)
    assert narrowed.shape[0] == len(keep) and last.shape[0] == 1
    torch.testing.assert_close(last, narrowed[-1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(last_cache.layer(0)[0][keep], narrowed_cache.layer(0)[0][keep], atol=0, rtol=0)


@torch.inference_mode()
def test_decoding_steps_between_a_prompt_s_layers_leave_both_as_they_were(tiny_model, prompt_ids):
    """A server decodes its running sequences between the layers of a long prompt (`between_layers`): the prompt's
    logits and KV, and the decoded sequence's, equal each computed alone, and the steps run between the prompt's
    layers only, not inside their own."""
    running = tiny_model.prefill(prompt_ids[:9])
    alone = tiny_model.prefill(prompt_ids[:9])
    token = int(running.logits.argmax())
    expected = []
    steps = []

    def decode_one_step() -> None:
        nonlocal token
        steps.append(len(steps))
        logits = tiny_model.decode(token, running.cache)
        expected.append(tiny_model.decode(token, alone.cache))
        torch.testing.assert_close(logits, expected[-1], atol=1e-4, rtol=0)
        token = int(logits.argmax())

    with tiny_model.between_layers(decode_one_step):
        paused = tiny_model.prefill(prompt_ids)
    whole = tiny_model.prefill(prompt_ids)
    assert len(steps) == tiny_model.num_layers - 1  # between every two layers, none inside the decoding steps
    torch.testing.assert_close(paused.logits, whole.logits, atol=1e-4, rtol=0)
    for layer in range(tiny_model.num_layers):
        torch.testing.assert_close(paused.cache.layer(layer)[0], whole.cache.layer(layer)[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(running.cache.layer(layer)[1], alone.cache.layer(layer)[1], atol=1e-4, rtol=0)
    tiny_model.prefill(prompt_ids[:5])  # outside the block: no step
    assert len(steps) == tiny_model.num_layers - 1
