"""The runtime's matrix product (oneDNN on packed weights; a few fp32 rows over weights in panels) equals
nn.Linear's, stacked projections equal each one alone, and a changed weight is followed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kvreuse.model import native
from kvreuse.model.linear import linear, onednn_available, route


@pytest.mark.parametrize("threads", [1, 2])
# both sides of most_panel_rows where it has a limit (1024 or 2048; fp32 with AVX-512 and AMX has none)
@pytest.mark.parametrize("rows", [1, 3, 16, 256, 257, 600, 1024, 1025, 2048, 2049])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_linear_equals_nn_linear(threads, rows, bias):
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = linear(x, layer)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, layer(x), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_bf16_linear_equals_nn_linear_within_bf16_rounding():
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, layer).float(), layer(x).float(), atol=0.03, rtol=0.02)


def test_a_weight_changed_or_replaced_is_packed_again():
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        linear(x, layer)
        layer.weight.mul_(-2)  # in place: same tensor, new version
        torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
        layer.weight = nn.Parameter(torch.randn(8, 16))
        torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 16, 257, 600, 1025])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_plus_adds_a_residual_exactly_as_adding_after(rows, bias):
    layer = nn.Linear(24, 40, bias=bias)
    x, residual = torch.randn(rows, 24), torch.randn(rows, 40)
    kept = residual.clone()
    # fp32: oneDNN and the panels' kernel add it as they write the product: the same sums as adding after
    assert torch.equal(linear(x, layer, plus=residual), residual + linear(x, layer))
    assert torch.equal(residual, kept)  # the residual itself is left as it was


@torch.inference_mode()
def test_bf16_plus_adds_to_the_product_rounded_to_bf16():
    layer = nn.Linear(64, 48).to(torch.bfloat16)
    x, residual = torch.randn(20, 64, dtype=torch.bfloat16), torch.randn(20, 48, dtype=torch.bfloat16)
    assert torch.equal(linear(x, layer, plus=residual), residual + linear(x, layer))


@torch.inference_mode()
def test_non_contiguous_rows():
    layer = nn.Linear(16, 8)
    x = torch.randn(16, 10).T  # [10, 16], transposed view
    torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("biases", [(False, False, False), (True, True, True), (False, True, False)])
@torch.inference_mode()
def test_stacked_projections_equal_each_projection_side_by_side(rows, biases):
    layers = [nn.Linear(24, out, bias=bias) for out, bias in zip((32, 8, 8), biases)]
    x = torch.randn(rows, 24)
    got = linear(x, *layers)
    assert got.shape == (rows, 48)
    torch.testing.assert_close(got, torch.cat([layer(x) for layer in layers], -1), atol=1e-5, rtol=1e-5)


def _replacement(old: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
    """A new parameter holding `values` whose version counter has reached the old one's."""
    new = nn.Parameter(values)
    with torch.no_grad():
        while new._version < old._version:
            new.mul_(1.0)
    assert new._version == old._version
    return new


def test_a_stacked_group_follows_a_change_to_any_of_its_weights_or_biases():
    layers = [nn.Linear(16, 8), nn.Linear(16, 4, bias=False), nn.Linear(16, 4)]
    x = torch.randn(3, 16)

    def expected():
        return torch.cat([layer(x) for layer in layers], -1)

    with torch.no_grad():
        linear(x, *layers)
        layers[1].weight.mul_(-2)  # a later member of the group, in place
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        layers[2].bias.add_(1.0)
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        layers[2].weight = nn.Parameter(torch.randn(4, 16))
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        # replaced by tensors whose version counters equal the old ones': only their identity tells them apart
        layers[1].weight = _replacement(layers[1].weight, torch.randn(4, 16))
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        layers[0].bias = _replacement(layers[0].bias, torch.randn(8))
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        layers[1].bias = nn.Parameter(torch.randn(4))  # a bias where there was none
        torch.testing.assert_close(linear(x, *layers), expected(), atol=1e-5, rtol=1e-5)
        # the group's first layer alone is another product, not the group's pack
        torch.testing.assert_close(linear(x, layers[0]), layers[0](x), atol=1e-5, rtol=1e-5)


def test_the_runtime_packs_every_projection_when_it_loads(make_tiny):
    """The first request must not pay for packing: the runtime packs the model's projections on construction,
    each in the group it runs in."""
    from kvreuse.model import linear as linear_module
    from kvreuse.model.runtime import LayerwiseModel

    hf_model = make_tiny("llama")
    weights = {id(m.weight) for m in hf_model.modules() if isinstance(m, nn.Linear)}
    packed_before = {id(t) for packed in linear_module._packed.values() for t in packed.sources}
    assert not weights & packed_before
    LayerwiseModel(hf_model)
    packed = {id(t) for packed in linear_module._packed.values() for t in packed.sources}
    assert weights <= packed


@pytest.mark.skipif(not native.available(), reason="no native kernels")
@torch.inference_mode()
def test_a_weight_packed_while_the_native_kernels_were_off_gets_its_panels_when_they_are_on(monkeypatch):
    layer = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with native.disabled():
        torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
    calls = []
    kernel = native.panel_rows
    monkeypatch.setattr(native, "panel_rows", lambda *args: calls.append(args) or kernel(*args))
    torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
    assert len(calls) == 1


@pytest.mark.skipif(not native.available() or native.most_panel_rows(torch.float32) != native.ANY_ROWS,
                    reason="fp32 products of any rows take the panels with AVX-512 and AMX only")
@torch.inference_mode()
def test_with_avx512_fp32_products_of_any_rows_take_the_panels_and_make_no_onednn_copy():
    from kvreuse.model import linear as linear_module

    layer = nn.Linear(24, 40)
    linear_module.pack_weights([[layer]])
    x = torch.randn(5000, 24)
    assert route(x, layer) == "panels"
    torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
    assert linear_module._packed[layer].panels is not None and linear_module._packed[layer].onednn is None


@pytest.mark.skipif(not native.panels_take(torch.float32), reason="no panels of fp32 on this CPU")
@torch.inference_mode()
def test_onednn_s_copy_of_a_weight_is_made_once_a_product_runs_there(monkeypatch):
    from kvreuse.model import linear as linear_module

    monkeypatch.setattr(native, "most_panel_rows", lambda dtype: 40)
    layer = nn.Linear(24, 40)
    fewer, more = torch.randn(40, 24), torch.randn(41, 24)
    torch.testing.assert_close(linear(fewer, layer), layer(fewer), atol=1e-5, rtol=1e-5)
    assert linear_module._packed[layer].onednn is None
    assert route(more, layer) == "onednn-packed"
    torch.testing.assert_close(linear(more, layer), layer(more), atol=1e-5, rtol=1e-5)
    assert linear_module._packed[layer].onednn is not None
    other = nn.Linear(24, 8)
    linear_module.pack_weights([[other]])  # where oneDNN takes some products, loading packs for it too
    assert linear_module._packed[other].onednn is not None


def test_where_onednn_has_no_bf16_path_bf16_products_run_widened_to_fp32(monkeypatch):
    """oneDNN refuses to pack bf16 weights on CPUs without AVX512 (BW, VL, DQ) or AVX-NE-CONVERT (a Zen 3 EPYC):
    there bf16 is not among its dtypes, and a bf16 layer's weights are packed widened to fp32. Its products are
    then the same exact products summed in fp32, rounded to bf16, and a residual is added after the rounding."""
    from kvreuse.model import linear as linear_module

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert linear_module.onednn_dtypes() == (torch.float32,)
    monkeypatch.setattr(linear_module, "_ONEDNN_DTYPES", linear_module.onednn_dtypes())
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def refuse_bf16(weight, rows):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return reorder(weight, rows)

    def no_torch_product(*args, **kwargs):
        raise AssertionError("a bf16 product went to torch's own")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse_bf16)
    generator = torch.Generator().manual_seed(3)
    layers = [nn.Linear(64, 48).to(torch.bfloat16), nn.Linear(64, 16, bias=False).to(torch.bfloat16)]
    with torch.inference_mode():
        # past few_rows' 3 rows; 1025 past the panels too (which take bf16 with AVX512-BF16)
        for rows in (4, 16, 1025):
            x = torch.randn(rows, 64, generator=generator).bfloat16()
            residual = torch.randn(rows, 64, generator=generator).bfloat16()
            widened = torch.cat([x.double() @ layer.weight.double().T + (0 if layer.bias is None else
                                 layer.bias.double()) for layer in layers], -1)
            with monkeypatch.context() as patched:
                patched.setattr(nn.functional, "linear", no_torch_product)
                got = linear(x, *layers)
                added = linear(x, layers[0], plus=residual[:, :48])
            assert got.dtype == torch.bfloat16 and added.dtype == torch.bfloat16
            # fp32 sums of exact products, rounded once: within one bf16 rounding of the fp64 product
            torch.testing.assert_close(got.double(), widened, atol=1e-2, rtol=2 ** -8)
            assert torch.equal(added, linear(x, layers[0]) + residual[:, :48])


# A fresh process makes oneDNN products of many row counts and reports how much its anonymous memory grew: each
# primitive of these shapes holds about 2 MB, and oneDNN and ideep keep 1024 of them unless told otherwise.
_PRODUCTS_OF_MANY_ROW_COUNTS = """
import kvreuse.model.linear
import torch

def anonymous_bytes():
    status = open("/proc/self/status").read().splitlines()
    return int(next(line for line in status if line.startswith("RssAnon")).split()[1]) * 1024

torch.set_grad_enabled(False)
in_features, out_features = 576, 512
packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_features, in_features), 2048)
rows = torch.randn(2300, in_features)
for count in (2000, 2001):
    torch.ops.mkldnn._linear_pointwise(rows[:count], packed, None, "none", [], "")
before = anonymous_bytes()
for count in range(2002, 2202):
    torch.ops.mkldnn._linear_pointwise(rows[:count], packed, None, "none", [], "")
print(anonymous_bytes() - before)
"""


def _growth_over_many_row_counts(capacities: dict[str, str]) -> int:
    env = {name: value for name, value in os.environ.items()
           if name not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", _PRODUCTS_OF_MANY_ROW_COUNTS], env={**env, **capacities},
                          capture_output=True, text=True, timeout=300, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not onednn_available() or not Path("/proc/self/status").exists(),
                    reason="no oneDNN products or no /proc here")
def test_onednn_keeps_a_bounded_number_of_primitives_however_many_row_counts_it_sees():
    # 200 row counts kept would be about 430 MB; the 16 kvreuse lets each cache keep, about 35.
    assert _growth_over_many_row_counts({}) < 150e6
    # A capacity the user set stands (which also shows the measurement sees primitives kept).
    users = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"}
    assert _growth_over_many_row_counts(users) > 300e6


def test_only_the_capacities_the_user_left_unset_are_set_and_named_so():
    """The names kvreuse set are what a peer engine's process is started without (bench.peers.vllm_peer)."""
    script = ("import os, kvreuse.model.linear as linear; print(linear.ONEDNN_CAPACITIES_SET, "
              "os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    env = {name: value for name, value in os.environ.items()
           if name not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", script], env={**env, "LRU_CACHE_CAPACITY": "5"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["('ONEDNN_PRIMITIVE_CACHE_CAPACITY',)", "16", "5"]
