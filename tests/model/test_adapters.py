"""What the family adapters add to the layer step: the MLP in passes of bounded size, each family's attention window,
and the options of a family the runtime refuses."""

import pytest
import torch

from kvreuse.model import adapters, native
from kvreuse.model.adapters import UnsupportedModelError
from kvreuse.model.runtime import LayerwiseModel


@torch.inference_mode()
def test_the_mlp_in_passes_equals_one_pass(tiny_model, monkeypatch):
    prompt = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    one_pass = tiny_model.prefill(prompt)
    mlp = tiny_model.layers[0].mlp
    row_bytes = 2 * mlp.gate_proj.out_features * 4  # fp32 gate and up values of a row
    monkeypatch.setattr(adapters, "MLP_PASS_BYTES", 7 * row_bytes)
    passes = []
    run_pass = adapters.LlamaAdapter._mlp_pass
    monkeypatch.setattr(adapters.LlamaAdapter, "_mlp_pass",
                        lambda self, mlp, x, plus, int8:
                        passes.append(x.shape[0]) or run_pass(self, mlp, x, plus, int8))
    in_passes = tiny_model.prefill(prompt)
    # every layer but the last in passes of 7 rows; the last one's MLP runs the prompt's last row alone (in one
    # native call with the rest of the layer's end, where that runs)
    before_last = 9 * (tiny_model.num_layers - 1)
    assert passes[:before_last] == ([7] * 8 + [4]) * (tiny_model.num_layers - 1)
    assert passes[before_last:] in ([], [1])
    torch.testing.assert_close(in_passes.logits, one_pass.logits, atol=1e-5, rtol=0)
    for layer in range(tiny_model.num_layers):
        torch.testing.assert_close(in_passes.cache.layer(layer)[0], one_pass.cache.layer(layer)[0], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_a_layers_parts_in_one_native_call_each_give_what_the_kernels_give_apart(tiny_model, monkeypatch):
    """The input norm with the q/k/v product, and the layer's end, each in one call (native.normed_panel_rows,
    native.layer_end) where the products run in panels: a prefill and a decoding step to the bit as with each kernel
    called on its own (or as the family's own modules where those run: Gemma 3)."""
    prompt = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(4)).tolist()

    def prefill_and_step():
        result = tiny_model.prefill(prompt, cache=tiny_model.new_cache(40))
        return result, tiny_model.decode(int(result.logits.argmax()), result.cache)

    (in_parts, step_in_parts) = prefill_and_step()
    monkeypatch.setattr(native, "parts_take", lambda *args: False)
    (apart, step_apart) = prefill_and_step()
    assert torch.equal(in_parts.logits, apart.logits) and torch.equal(step_in_parts, step_apart)
    for layer in range(tiny_model.num_layers):
        assert torch.equal(in_parts.cache.layer(layer)[0], apart.cache.layer(layer)[0])


@torch.inference_mode()
def test_a_llama_mlp_of_another_activation_runs_its_own_activation(make_tiny):
    """The layer's end in one native call applies SiLU: an MLP with another activation ends apart, as its module
    computes it."""
    from kvreuse.model.check import check_prefill_logits

    hf_model = make_tiny("llama")
    for block in hf_model.model.layers:
        block.mlp.act_fn = torch.nn.GELU()
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    result = check_prefill_logits(LayerwiseModel(hf_model), prompt)
    assert result.passed, result.detail


@pytest.mark.parametrize(("family", "window"), [("llama", None), ("mistral-window", 24)])
@torch.inference_mode()
def test_a_config_s_sliding_window_applies_only_where_the_family_s_attention_reads_it(make_tiny, family, window):
    """A config.json key stays an attribute of the config whether the modelling code reads it or not: Mistral's
    attention reads `sliding_window`, Llama's never does, so a Llama with one attends over the whole context, as
    transformers computes it."""
    hf_model = make_tiny(family)
    hf_model.config.sliding_window = 24
    model = LayerwiseModel(hf_model)
    assert model.windows == [window] * model.num_layers
    prompt = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(7))  # past the window
    reference = hf_model(prompt[None]).logits[0, -1]
    torch.testing.assert_close(model.prefill(prompt).logits, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("option", "value", "refusal"), [
    ("attn_logit_softcapping", 50.0, "soft-capping"),
    ("use_bidirectional_attention", True, "bidirectional attention"),
])
def test_gemma3_options_attention_by_position_cannot_compute_are_refused(make_tiny, option, value, refusal):
    hf_model = make_tiny("gemma3")
    setattr(hf_model.config, option, value)
    with pytest.raises(UnsupportedModelError, match=refusal):
        LayerwiseModel(hf_model)
