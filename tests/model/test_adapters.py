"""What the family adapters add to the layer step: the MLP in passes of bounded size."""

import torch

from kvreuse.model import adapters


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
                        lambda self, mlp, x, plus: passes.append(x.shape[0]) or run_pass(self, mlp, x, plus))
    in_passes = tiny_model.prefill(prompt)
    # every layer but the last in passes of 7 rows; the last one's MLP runs the prompt's last row alone
    assert passes == ([7] * 8 + [4]) * (tiny_model.num_layers - 1) + [1]
    torch.testing.assert_close(in_passes.logits, one_pass.logits, atol=1e-5, rtol=0)
    for layer in range(tiny_model.num_layers):
        torch.testing.assert_close(in_passes.cache.layer(layer)[0], one_pass.cache.layer(layer)[0], atol=1e-5, rtol=0)
