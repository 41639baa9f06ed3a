"""The machine's limit for a prefill and a decoding step: FLOPs and bytes counted from the model's own shapes,
rates measured here."""

from __future__ import annotations

import pytest
import torch

from kvreuse.bench.machine import (
    MachineLimit,
    decode_step_bytes,
    decode_step_flops,
    layer_linears,
    measure,
    prefill_flops,
    routes,
    weight_bytes,
)
from kvreuse.model import linear as linear_module
from kvreuse.model import native
from kvreuse.model.runtime import LayerwiseModel


def test_prefill_flops_count_every_layer_s_matmuls_causal_attention_and_one_row_of_the_lm_head(make_tiny):
    model = LayerwiseModel(make_tiny("llama"))
    config = model.config
    hidden, inner, heads, kv_heads = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                                      config.num_key_value_heads)
    head_dim = model.head_dim
    per_token = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
                 + 3 * hidden * inner)  # gate, up, down
    assert sum(m.in_features * m.out_features for m in layer_linears(model)) == per_token
    n = 10
    attention = 2 * 2 * heads * head_dim * n * (n + 1) / 2
    expected = model.num_layers * (2 * n * per_token + attention) + 2 * hidden * config.vocab_size
    assert prefill_flops(model, n) == pytest.approx(expected)
    assert prefill_flops(model, 2 * n) > 2 * prefill_flops(model, n) - 2 * hidden * config.vocab_size


def test_the_floor_is_the_longer_of_compute_and_weight_reads(make_tiny):
    limit = MachineLimit("float32", 64, dense_flops_per_second=1e9, bytes_per_second=1e8, route="torch")
    assert limit.floor_seconds(2e9, 1e7) == pytest.approx(2.0)
    assert limit.floor_seconds(1e6, 1e9) == pytest.approx(10.0)
    model = LayerwiseModel(make_tiny("llama"))
    measured = measure(model, rows=32, repeats=2)
    assert measured.dense_flops_per_second > 0 and measured.bytes_per_second > 0 and measured.rows == 32
    # untied: the input embedding table is only gathered from, a row per token
    table = model.hf_model.get_input_embeddings().weight.numel() * 4
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.hf_model.parameters()) - table
    assert measured.dtype == str(torch.float32).removeprefix("torch.")
    assert measured.route in ("torch", "onednn-packed", "panels")


def test_the_route_named_is_the_one_linear_takes(monkeypatch):
    """The floor's route says which product ran: native's panels up to their row limit, oneDNN above it."""
    if not native.available():
        pytest.skip("no native kernels: no panels")
    kernel, calls = native.panel_rows, []
    monkeypatch.setattr(native, "panel_rows", lambda *args: calls.append(args) or kernel(*args))
    monkeypatch.setattr(native, "most_panel_rows", lambda dtype: 16)
    layer = torch.nn.Linear(24, 40)
    for rows, route in ((16, "panels"), (17, "onednn-packed" if linear_module.onednn_available() else "torch")):
        calls.clear()
        linear_module.linear(torch.randn(rows, 24), layer)
        assert linear_module.route(torch.randn(rows, 24), layer) == route and bool(calls) == (route == "panels")


def test_rows_past_the_panels_limit_are_also_timed_in_passes_through_the_panels(make_tiny, monkeypatch):
    """A prefill longer than the panels take could still run its products there, a pass at a time: the floor's rate
    is the best of that too."""
    if not native.available():
        pytest.skip("no native kernels: no panels")
    model = LayerwiseModel(make_tiny("llama"))
    kernel, row_counts = native.panel_rows, []
    monkeypatch.setattr(native, "panel_rows",
                        lambda rows, *args: row_counts.append(rows.shape[0]) or kernel(rows, *args))
    monkeypatch.setattr(native, "most_panel_rows", lambda dtype: 16)
    measured = measure(model, rows=40, repeats=1)
    assert set(row_counts) == {16, 8}  # passes of 16, 16 and 8 rows
    assert measured.route in ("torch", "onednn-packed", "panels, 16-row passes")
    layer = model.layers[0].mlp.down_proj
    assert "panels, 16-row passes" not in routes(torch.randn(16, layer.in_features), (layer,))  # rows the panels take
    if not native.panels_take(torch.bfloat16):  # passes of bf16 rows would not run in panels here
        bf16 = LayerwiseModel(make_tiny("llama").to(torch.bfloat16)).layers[0].mlp.down_proj
        assert "panels, 16-row passes" not in routes(torch.randn(40, layer.in_features, dtype=torch.bfloat16), (bf16,))


def test_a_decoding_step_reads_the_weights_once_and_every_sequence_s_kv(make_tiny):
    model = LayerwiseModel(make_tiny("llama"))
    config = model.config
    kv_row = 2 * model.num_layers * config.num_key_value_heads * model.head_dim * 4  # keys and values, fp32
    assert decode_step_bytes(model, 3, 100) == weight_bytes(model) + 3 * 100 * kv_row
    dense = sum(m.in_features * m.out_features for m in layer_linears(model))
    per_sequence = (model.num_layers * (2 * dense + 2 * 2 * config.num_attention_heads * model.head_dim * 100)
                    + 2 * config.hidden_size * config.vocab_size)
    assert decode_step_flops(model, 3, 100) == pytest.approx(3 * per_sequence)
