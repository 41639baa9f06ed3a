"""A step's layers as native calls resolved once (`ResolvedStep`): the same results as the general step to the bit,
for a prompt's rows, rows scattered over a cache, one decoding sequence in its own cache and a pool's sequences; and
the general step wherever the resolved calls do not cover a step."""

from __future__ import annotations

import pytest
import torch

from kvreuse.model import native
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.kv_pool import KVPool
from kvreuse.model.resolved_step import ResolvedStep
from kvreuse.model.runtime import LayerwiseModel, RowGroup, Straight
from tests.conftest import make_tiny_model, random_ids, routed_as_if_amx_bf16

# Families whose layers the resolved calls run (Llama's norms and products, windows, a qkv bias); Qwen3 and Gemma 3
# normalise q and k between the product and RoPE, which the general step does.
RESOLVED = ["llama", "llama3-rope", "mistral", "mistral-window", "qwen2"]
GENERAL_ONLY = ["qwen3", "gemma3"]

pytestmark = pytest.mark.skipif(not native.panels_take(torch.float32), reason="needs the native kernels")


def tiny(family: str, dtype: torch.dtype = torch.float32) -> LayerwiseModel:
    """A tiny model of `family` whose biases (Qwen2's q/k/v) are random, not the zeros they are made with."""
    hf_model = make_tiny_model(family)
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(std=0.3)
    return LayerwiseModel(hf_model.to(dtype))


def layers_resolved(monkeypatch) -> list[int]:
    """The layers `ResolvedStep.run_layer` runs from here on, in order."""
    ran: list[int] = []
    run_layer = ResolvedStep.run_layer
    monkeypatch.setattr(ResolvedStep, "run_layer", lambda self, layer, hidden: ran.append(layer)
                        or run_layer(self, layer, hidden))
    return ran


def general_step_only(monkeypatch) -> None:
    monkeypatch.setattr(ResolvedStep, "of", staticmethod(lambda model, shape: None))


def prefilled(model: LayerwiseModel, lengths: list[int], pooled: bool) -> list:
    """Caches of random prompts of these lengths (past the tiny windows of 24 rows), in a pool's slots in order if
    `pooled`."""
    caches = [model.prefill(random_ids(n, seed=n)).cache for n in lengths]
    if not pooled:
        return caches
    pool = KVPool.for_model(model, len(caches), 1 << 30)
    return [pool.adopt(cache, capacity=cache.length + 16) for cache in caches]


def decode_steps(model: LayerwiseModel, caches: list, steps: int) -> list[torch.Tensor]:
    tokens, logits = [5 + i for i in range(len(caches))], []
    for _ in range(steps):
        logits.append(model.decode_batch(tokens, caches))
        tokens = logits[-1].argmax(-1).tolist()
    return logits


def assert_same_caches(a_caches: list, b_caches: list, layers: int) -> None:
    for a, b in zip(a_caches, b_caches):
        assert torch.equal(a.positions, b.positions)
        for layer in range(layers):
            assert all(torch.equal(x, y) for x, y in zip(a.layer(layer), b.layer(layer)))


@pytest.mark.parametrize("family", RESOLVED)
@pytest.mark.parametrize("lengths", [[40], [40, 9, 27]], ids=["one sequence", "a pool of three"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoding_steps_give_the_general_step_s_logits_and_kv_to_the_bit(family, lengths, dtype, monkeypatch):
    if not native.panels_take(dtype):
        pytest.skip(f"the native kernels take no {dtype} panels on this CPU")
    model = tiny(family, dtype)
    pooled = len(lengths) > 1
    resolved_caches, general_caches = prefilled(model, lengths, pooled), prefilled(model, lengths, pooled)
    ran = layers_resolved(monkeypatch)
    resolved = decode_steps(model, resolved_caches, steps=4)
    assert ran == list(range(model.num_layers)) * 4
    general_step_only(monkeypatch)
    general = decode_steps(model, general_caches, steps=4)
    assert len(ran) == 4 * model.num_layers
    for a, b in zip(resolved, general):
        assert torch.equal(a, b)
    assert_same_caches(resolved_caches, general_caches, model.num_layers)


@pytest.mark.parametrize("family", GENERAL_ONLY)
def test_families_normalising_q_and_k_decode_in_the_general_step(family, monkeypatch):
    model = tiny(family)
    ran = layers_resolved(monkeypatch)
    decode_steps(model, prefilled(model, [30], pooled=False), steps=2)
    assert ran == []


@pytest.mark.parametrize("family", RESOLVED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prompt_and_its_continuation_give_the_general_step_s_logits_and_kv_to_the_bit(family, dtype, monkeypatch):
    """A prompt's rows go through every layer but the last resolved (the last layer's rows are cut to the last row:
    the general step); a continuation's rows attend over the cache before them too."""
    if not native.panels_take(dtype):
        pytest.skip(f"the native kernels take no {dtype} panels on this CPU")
    routed_as_if_amx_bf16(monkeypatch, False)  # with AMX-BF16, bf16 takes panels for a few rows only
    model = tiny(family, dtype)
    prompt, continuation = random_ids(40, seed=1), random_ids(13, seed=2)

    def run() -> tuple[list[torch.Tensor], object]:
        first = model.prefill(prompt)
        return [first.logits, model.prefill(continuation, first.cache).logits], first.cache

    with pytest.MonkeyPatch.context() as patch:
        ran = layers_resolved(patch)
        resolved, resolved_cache = run()
        assert ran == list(range(model.num_layers - 1)) * 2
    general_step_only(monkeypatch)
    general, general_cache = run()
    assert all(torch.equal(a, b) for a, b in zip(resolved, general))
    assert_same_caches([resolved_cache], [general_cache], model.num_layers)


@pytest.mark.parametrize("family", RESOLVED)
def test_rows_scattered_over_a_cache_give_the_general_step_s_output_and_kv_to_the_bit(family, monkeypatch):
    """A plan's recomputed rows: written at their rows by index, each attending the cache's rows by position."""
    model = tiny(family)
    prompt = random_ids(48, seed=3)
    rows = torch.tensor([0, 3, 4, 17, 18, 19, 30, 41, 47])

    @torch.inference_mode()
    def run() -> tuple[torch.Tensor, object]:
        cache = model.prefill(prompt).cache
        group = RowGroup(cache, rows, rows, model.rotary(rows))
        driver = Straight(model.embed(torch.tensor(prompt)[rows]), [group])
        model.run_layers(range(model.num_layers), driver)
        return driver.hidden, cache

    with pytest.MonkeyPatch.context() as patch:
        ran = layers_resolved(patch)
        resolved, resolved_cache = run()
        assert ran == list(range(model.num_layers - 1)) + list(range(model.num_layers))  # the prompt, the rows
    general_step_only(monkeypatch)
    general, general_cache = run()
    assert torch.equal(resolved, general)
    assert_same_caches([resolved_cache], [general_cache], model.num_layers)


def test_several_requests_rows_and_a_pool_out_of_slot_order_take_the_general_step(monkeypatch):
    model = tiny("llama")
    caches = prefilled(model, [12, 20], pooled=True)
    alone = prefilled(model, [15, 9], pooled=False)
    ran = layers_resolved(monkeypatch)
    model.decode_batch([5, 6], caches[::-1])
    model.decode_batch([5, 6], alone)  # a cache each, no pool: per-request attention in the general step
    assert ran == []
    model.decode_batch([5, 6], caches)
    assert ran == list(range(model.num_layers))


def test_a_pool_whose_values_are_not_laid_out_as_its_keys_takes_the_general_step(monkeypatch):
    """The pooled kernel call reads a layer's values by its keys' strides: a pool whose keys and values differ (as a
    growth that failed part way left them) goes to the general step, whose kernel refuses it, never to that call."""
    model = tiny("llama")
    caches = prefilled(model, [12, 20], pooled=True)
    pool = caches[0].pool
    # the same rows, laid out with each row's heads side by side: as many bytes, other strides
    pool.values[1] = pool.values[1].transpose(1, 2).contiguous().transpose(1, 2)
    ran = layers_resolved(monkeypatch)
    with pytest.raises(ValueError, match="decode_attention: keys and values must share a layout"):
        model.decode_batch([5, 6], caches)
    assert ran == []


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_cache_of_another_dtype_than_the_model_s_takes_the_general_step(cache_dtype, monkeypatch):
    """The prefill kernel reads a cache as the model's dtype: an fp32 model's prompt over a bf16 cache would read its
    2-byte rows as 4-byte ones, out of bounds and silently. The general step runs it, where torch refuses the mix."""
    model = tiny("llama")
    # twice the prompt's rows: what the kernel read of a 2-byte cache, unfixed, stayed within its memory
    cache = KVCache(model.num_layers, model.num_kv_heads, model.head_dim, cache_dtype, capacity=80)
    ran = layers_resolved(monkeypatch)
    with pytest.raises(RuntimeError, match="same dtype"):
        model.prefill(random_ids(40, seed=1), cache=cache)
    assert ran == []


@pytest.mark.parametrize("change", ["in place", "replaced"])
def test_a_weight_changed_between_steps_is_the_one_the_next_step_uses(change):
    """The layers' resolved weights are kept between steps only while every parameter is the tensor, at the
    version, it was (their packing notices a change too: kvreuse.model.linear)."""
    model = tiny("llama")
    resolved, general, unchanged = (prefilled(model, [25], pooled=False) for _ in range(3))
    first = decode_steps(model, resolved, steps=1)[0]
    token = first.argmax(-1).tolist()
    decode_steps(model, unchanged, steps=1)
    before_the_change = model.decode_batch(token, unchanged)
    with pytest.MonkeyPatch.context() as patch:
        general_step_only(patch)
        decode_steps(model, general, steps=1)
    down = model.layers[1].mlp.down_proj
    with torch.no_grad():
        if change == "in place":
            down.weight.mul_(-2)
        else:  # by a tensor whose version counter equals the old one's: only its identity tells them apart
            replacement = torch.nn.Parameter(down.weight * -2)
            while replacement._version < down.weight._version:
                replacement.add_(0)
            assert replacement._version == down.weight._version
            down.weight = replacement
    after = model.decode_batch(token, resolved)
    with pytest.MonkeyPatch.context() as patch:
        general_step_only(patch)
        assert torch.equal(after, model.decode_batch(token, general))
    assert not torch.equal(after, before_the_change)


def test_the_adapter_keeps_the_resolved_layers_of_a_few_rows_counts_only():
    """Prompts of many lengths do not grow what the adapter keeps between steps past NATIVE_LAYERS_KEPT."""
    from kvreuse.model.adapters import NATIVE_LAYERS_KEPT

    model = tiny("llama")
    for length in range(2, 2 + 2 * NATIVE_LAYERS_KEPT):
        model.prefill(random_ids(length, seed=length))
        assert 1 <= len(model.adapter._native_layers) <= NATIVE_LAYERS_KEPT
