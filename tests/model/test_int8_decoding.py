"""Decoding over int8 weights (`LayerwiseModel.decode_in_int8`): a decoding step multiplies every projection's and
the LM head's weights as rounded to int8 (the fp32 products of a model whose weights are `native.int8_dequantized`),
for one sequence and a pool; prompts keep the fp32 weights to the bit; switched off, decoding is fp32's again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kvreuse.model import native
from kvreuse.model.runtime import LayerwiseModel
from tests.conftest import make_tiny_model, random_ids
from tests.model.test_resolved_step import RESOLVED, layers_resolved, prefilled, tiny

pytestmark = pytest.mark.skipif(not native.panels_take(torch.float32), reason="needs the native kernels")


def int8_twin(model: LayerwiseModel) -> LayerwiseModel:
    """The model with every projection's and the LM head's weight replaced by its int8 rounding, in fp32 (the
    embedding keeps its own weight where the LM head shares it)."""
    hf_model = copy.deepcopy(model.hf_model)
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(native.int8_dequantized(module.weight.detach().clone()))
    return LayerwiseModel(hf_model)


def forced_steps(model: LayerwiseModel, caches: list, tokens: list[list[int]]) -> list[torch.Tensor]:
    """Each step's logits, decoding the given tokens (teacher-forced: both models see the same ones)."""
    return [model.decode_batch(step, caches) for step in tokens]


@pytest.mark.parametrize("family", RESOLVED)
@pytest.mark.parametrize("lengths", [[40], [40, 9, 27]], ids=["one sequence", "a pool of three"])
def test_decoding_multiplies_the_weights_rounded_to_int8(family, lengths, monkeypatch):
    model = tiny(family)
    pooled = len(lengths) > 1
    fp32_caches, int8_caches, twin_caches = (prefilled(model, lengths, pooled) for _ in range(3))
    tokens = [[5 + i + 7 * step for i in range(len(lengths))] for step in range(4)]
    fp32 = forced_steps(model, fp32_caches, tokens)
    twin = forced_steps(int8_twin(model), twin_caches, tokens)
    model.decode_in_int8()
    try:
        ran = layers_resolved(monkeypatch)
        int8 = forced_steps(model, int8_caches, tokens)
    finally:
        model.decode_in_int8(False)
    assert ran == list(range(model.num_layers)) * 4
    for got, expected, exact in zip(int8, twin, fp32):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert (got - exact).abs().max() > 1e-3  # the int8 rounding shows: not fp32's weights
    for got, expected in zip(int8_caches, twin_caches):  # the KV the steps wrote, from the same weights
        for layer in range(model.num_layers):
            for a, b in zip(got.layer(layer), expected.layer(layer)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_decode_of_one_token_decodes_in_int8_too():
    model = tiny("llama")
    int8_cache, twin_cache = (model.prefill(random_ids(30, seed=3)).cache for _ in range(2))
    twin = int8_twin(model).decode(9, twin_cache)
    model.decode_in_int8()
    try:
        torch.testing.assert_close(model.decode(9, int8_cache), twin, rtol=1e-4, atol=1e-4)
    finally:
        model.decode_in_int8(False)


def test_prompts_keep_the_fp32_weights_to_the_bit():
    """A prompt's KV may be stored and reused by requests of any engine: it never sees the int8 weights."""
    model = tiny("qwen2")
    prompt, continuation = random_ids(40, seed=1), random_ids(13, seed=2)

    def run():
        first = model.prefill(prompt)
        then = model.prefill(continuation, first.cache)  # a conversation's next turn: rows of a prompt too
        return first, then

    exact_first, exact_then = run()
    model.decode_in_int8()
    try:
        int8_first, int8_then = run()
    finally:
        model.decode_in_int8(False)
    assert torch.equal(exact_first.logits, int8_first.logits) and torch.equal(exact_then.logits, int8_then.logits)
    for layer in range(model.num_layers):
        assert all(torch.equal(a, b) for a, b in zip(exact_then.cache.layer(layer), int8_then.cache.layer(layer)))


def test_switched_off_decoding_is_fp32_s_to_the_bit():
    model = tiny("llama")
    before_cache, after_cache = (model.prefill(random_ids(30, seed=4)).cache for _ in range(2))
    before = model.decode(11, before_cache)
    model.decode_in_int8()
    model.decode_in_int8(False)
    assert torch.equal(model.decode(11, after_cache), before)


def test_a_weight_changed_after_switching_on_is_used_rounded():
    model = tiny("llama")
    model.decode_in_int8()
    try:
        with torch.no_grad():
            model.layers[0].mlp.down_proj.weight.mul_(3)
        int8_cache, twin_cache = (model.prefill(random_ids(30, seed=5)).cache for _ in range(2))
        torch.testing.assert_close(model.decode(9, int8_cache), int8_twin(model).decode(9, twin_cache),
                                   rtol=1e-4, atol=1e-4)
    finally:
        model.decode_in_int8(False)


def test_models_it_cannot_decode_are_refused_by_name():
    with pytest.raises(ValueError, match="fp32 model.*bfloat16"):
        tiny("llama", torch.bfloat16).decode_in_int8()
    qwen3 = LayerwiseModel(make_tiny_model("qwen3"))
    with pytest.raises(ValueError, match="Llama family.*Qwen3ForCausalLM"):
        qwen3.decode_in_int8()
    assert not qwen3.int8_decoding


def test_check_model_s_int8_figure_counts_the_steps_whose_top_token_moved():
    from kvreuse.model.check import int8_decoding_drift

    prompt = random_ids(30, seed=6)
    model = tiny("llama")
    exact = int8_twin(model)  # weights already on the int8 grid: int8 decoding is fp32's up to rounding
    assert "fp32's top token on 15 of 15 steps" in int8_decoding_drift(exact, prompt, new_tokens=16)
    drift = int8_decoding_drift(model, prompt, new_tokens=16)
    assert float(drift.rsplit(" ", 1)[1]) > 1e-3 and not model.int8_decoding  # switched off again
    assert "not available: int8 decoding runs layers of the Llama family" in int8_decoding_drift(
        LayerwiseModel(make_tiny_model("qwen3")), prompt)


def batch_layouts(model: LayerwiseModel) -> dict[str, list]:
    """Three sequences' caches as a server's batches may hold them; the steps of all but the first run the general
    step (the pool cannot attend them in slot order)."""
    in_order = prefilled(model, [12, 20, 31], pooled=True)
    holed = prefilled(model, [12, 20, 31], pooled=True)
    holed[1].pool.release(holed[1])  # a neighbour finished: its slot is free between the others
    mixed = prefilled(model, [12, 20, 31], pooled=True)[:2] + prefilled(model, [31], pooled=False)
    return {"in slot order": in_order, "out of slot order": in_order[::-1], "around a freed slot": holed[::2],
            "pooled and alone": mixed, "own caches": prefilled(model, [12, 20, 31], pooled=False)}


@pytest.mark.parametrize("layout", ["in slot order", "out of slot order", "around a freed slot", "pooled and alone",
                                    "own caches"])
def test_every_decoding_step_is_over_int8_weights_whatever_the_batch(layout):
    """A sequence's tokens must not depend on its neighbours: the general step, which runs batches the pool
    cannot attend in slot order, multiplies the int8 weights as the native calls do."""
    model = tiny("llama")
    twin_caches, caches = batch_layouts(model)[layout], batch_layouts(model)[layout]  # the same prompts' KV
    tokens = [5 + i for i in range(len(caches))]
    expected = int8_twin(model).decode_batch(tokens, twin_caches)
    model.decode_in_int8()
    try:
        torch.testing.assert_close(model.decode_batch(tokens, caches), expected, rtol=1e-4, atol=1e-4)
    finally:
        model.decode_in_int8(False)
