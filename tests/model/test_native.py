"""The C kernels (kvreuse.model.native): built once per source and CPU, equal to torch's results, used where the
runtime needs them, and never required (without them torch's kernels give the same results)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import resource
import shutil
import threading

import pytest
import torch
from torch import nn

from kvreuse.model import native
from kvreuse.model.adapters import MLP_PASS_BYTES
from kvreuse.model.allocator import keep_freed_memory
from kvreuse.model.attention import attention_mask
from kvreuse.model.linear import linear, route
from tests.conftest import routed_as_if_amx_bf16

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
needs_bf16_dot = pytest.mark.skipif(not native.panels_take(torch.bfloat16),
                                    reason="bf16 panels are built only with AVX512-BF16")


def _assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within float rounding. bf16: the same dtype, equal almost everywhere and never more than two bf16 steps
    apart (fp32 maths in another order can land a rounding on the other side, twice where two are chained), so
    that a rounding done at the wrong place or not at all fails."""
    assert got.dtype == expected.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-30, rtol=2**-6)
    assert got.eq(expected).float().mean() > 0.98, got.eq(expected).float().mean()


def _assert_bf16_product(got, x, weight, bias=None, residual=None) -> None:
    """A bf16 layer's output: the fp32 sum of the exact products, plus the bias, rounded once to bf16; a residual
    added to that rounded product and rounded again, as torch adds one to a bf16 layer's output. Checked within two
    roundings of the terms' scale, plus fp32's sums in another order (which can land a rounding on the other side,
    and matter beside an output that nearly cancels); most outputs equal, so that a rounding done at the wrong place
    or not at all fails."""
    product = (x.double() @ weight.double().T + (0 if bias is None else bias.double())).bfloat16()
    expected = product if residual is None else product + residual
    assert got.dtype == torch.bfloat16
    scale = product.double().abs() + (0 if residual is None else residual.double().abs())
    terms = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    assert ((got.double() - expected.double()).abs() <= scale * 2**-6 + terms * 2**-16).all()
    assert got.eq(expected).float().mean() > 0.98


DTYPES = [torch.float32, torch.bfloat16]


@contextlib.contextmanager
def _threads(threads: int):
    """torch's (and so the kernels') thread count set for a block."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_compiler
def test_a_machine_with_a_compiler_has_the_kernels():
    assert native.available()


@needs_compiler
def test_loading_the_kernels_leaves_the_float_environment_alone():
    """Built with -ffast-math, the library must not bring crtfastmath's flush-to-zero into the process."""
    assert native.available()
    assert float("5e-324") > 0
    assert torch.tensor(1e-44, dtype=torch.float32) > 0  # a denormal fp32 survives


@needs_compiler
def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    compiler = shutil.which(os.environ.get("CC", "cc"))
    first = native.build(compiler, tmp_path)
    built_at = first.stat().st_mtime_ns
    assert native.build(compiler, tmp_path) == first and first.stat().st_mtime_ns == built_at
    monkeypatch.setattr(native, "_cpu_identity", lambda: "another CPU")
    other = native.build(compiler, tmp_path)
    assert other != first and other.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no scratch left


@needs_compiler
def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    damaged = native.build(shutil.which(os.environ.get("CC", "cc")), tmp_path / "native")
    damaged.write_bytes(b"not a shared library")
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert damaged.read_bytes().startswith(b"\x7fELF")
    finally:
        native.library.cache_clear()


def test_a_failed_build_names_the_compiler_and_leaves_nothing(tmp_path):
    with pytest.raises(native.NativeBuildError, match="false failed on native.c"):
        native.build(shutil.which("false"), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_without_the_kernels_the_runtime_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    native.library.cache_clear()
    try:
        assert not native.available()
        layer = nn.Linear(24, 40)
        x = torch.randn(1, 24)
        with torch.inference_mode():
            torch.testing.assert_close(linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


@needs_compiler
def test_the_kernels_can_be_switched_off_for_a_while():
    with native.disabled():
        assert not native.available()
        with native.disabled():
            assert not native.available()
        assert not native.available()
    assert native.available()


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
# around tiles of 6 (AVX2) and 8 rows, and the last of a decoding step's few rows (STREAMING_ROWS, 16)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 9, 11, 16, 17, 1024])
@pytest.mark.parametrize("shape", [(40, 24), (7, 3), (1, 1), (1000, 576), (64, 1537)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plus", [False, True])
def test_panel_rows_equal_torch(threads, rows, shape, bias, plus):
    out_features, in_features = shape
    weight, x = torch.randn(shape), torch.randn(rows, in_features)
    b = torch.randn(out_features) if bias else None
    residual = torch.randn(rows, out_features) if plus else None
    with _threads(threads):
        got = native.panel_rows(x, native.panels(weight), out_features, b, residual)
    expected = x.double() @ weight.double().T + (b.double() if bias else 0) + (residual.double() if plus else 0)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # fp32 sums in another order: one running sum per output over up to 1537 products of unit scale
    torch.testing.assert_close(got.double(), expected, atol=2e-4, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("in_features", [576, 1537])
@pytest.mark.parametrize("rows", [13, 20])  # a decoding step's few rows (a last tile over zero rows), and more
def test_panel_rows_give_a_row_the_same_sums_in_a_full_tile_as_alone(in_features, rows):
    """A row's sums do not depend on the rows beside it (a decoding step gives a sequence the same logits in any
    batch): AVX2's full tiles run in assembly, the rest in C, each summing in the same order."""
    weight, x = torch.randn(40, in_features), torch.randn(rows, in_features)
    b, residual = torch.randn(40), torch.randn(rows, 40)
    laid = native.panels(weight)
    together = native.panel_rows(x, laid, 40, b, residual)
    for row in range(rows):
        assert torch.equal(together[row], native.panel_rows(x[row : row + 1], laid, 40, b, residual[row : row + 1])[0])


@needs_compiler
def test_panels_lay_a_weight_out_in_zero_padded_panels_of_outputs():
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)  # 5 outputs of 3 inputs
    width = native.library().panel_width()
    laid = native.panels(weight)
    assert laid.shape == (1, 3, width) and laid.is_contiguous()
    assert torch.equal(laid[0, :, :5], weight.T) and not laid[0, :, 5:].any()


@needs_bf16_dot
def test_bf16_panels_hold_each_outputs_inputs_in_pairs():
    weight = torch.arange(5 * 3, dtype=torch.float32).view(5, 3).bfloat16()  # 5 outputs of 3 inputs: 2 pairs
    width = native.library().panel_width()
    laid = native.panels(weight)
    assert laid.shape == (1, 2, width, 2) and laid.is_contiguous()
    assert torch.equal(laid[0, 0, :5], weight[:, 0:2]) and torch.equal(laid[0, 1, :5, 0], weight[:, 2])
    assert not laid[0, 1, :, 1].any() and not laid[0, :, 5:].any()  # the odd input's pair and the outputs past 5


def _bf16_panels_in(tiles: str) -> contextlib.AbstractContextManager:
    """bf16 panels multiplied in `tiles`: "amx" (where the CPU has them; else the test is skipped) or "vectors"."""
    if tiles == "vectors":
        return native.bf16_panels_in_vectors()
    if not (native.bf16_in_amx() and native._amx_permitted()):
        pytest.skip("bf16 panels in AMX tiles need a CPU with AMX-BF16")
    return contextlib.nullcontext()


@needs_bf16_dot
@pytest.mark.parametrize("tiles", ["vectors", "amx"])
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 17, 40, 1024])  # AMX: one tile, then tiles with a last one padded
@pytest.mark.parametrize("shape", [(40, 24), (7, 3), (1000, 576), (40, 64), (64, 1537)])  # AMX: 576 and 64 inputs
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plus", [False, True])
def test_bf16_panel_rows_round_the_product_once_and_add_the_residual_after(tiles, rows, shape, bias, plus):
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows * 10_000 + out_features)
    weight, x = (torch.randn(size, generator=generator).bfloat16() for size in (shape, (rows, in_features)))
    b = torch.randn(out_features, generator=generator).bfloat16() if bias else None
    residual = torch.randn(rows, out_features, generator=generator).bfloat16() if plus else None
    with _bf16_panels_in(tiles):
        got = native.panel_rows(x, native.panels(weight), out_features, b, residual)
    _assert_bf16_product(got, x, weight, b, residual)


@needs_bf16_dot
def test_bf16_panels_run_in_amx_tiles_where_linux_grants_them_over_whole_tiles_of_inputs():
    """The tiles' sums round apart from vdpbf16ps's on some outputs (they add each pair's products in another
    order): the product is the tiles' over 576 inputs, and vdpbf16ps's over 1537, no whole number of tiles."""
    with _bf16_panels_in("amx"):
        generator = torch.Generator().manual_seed(0)
        for in_features, in_tiles in ((576, True), (1537, False)):
            weight = torch.randn(1000, in_features, generator=generator).bfloat16()
            x = torch.randn(64, in_features, generator=generator).bfloat16()
            laid = native.panels(weight)
            product = native.panel_rows(x, laid, 1000)
            with native.bf16_panels_in_vectors():
                in_vectors = native.panel_rows(x, laid, 1000)
            assert torch.equal(product, in_vectors) != in_tiles, in_features


@needs_bf16_dot
@pytest.mark.parametrize("tiles", ["vectors", "amx"])
@pytest.mark.parametrize("rows", [13, 20])
def test_bf16_panel_rows_give_a_row_the_same_sums_among_others_as_alone(tiles, rows):
    """A decoding step gives a sequence the same logits in any batch: in AMX tiles a row's sums are its own, in a
    tile of its height alone, in one of 16 rows, or in a last tile padded with zero rows."""
    generator = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(40, 576, generator=generator).bfloat16(), torch.randn(rows, 576, generator=generator)
    x, b, residual = x.bfloat16(), torch.randn(40).bfloat16(), torch.randn(rows, 40).bfloat16()
    laid = native.panels(weight)
    with _bf16_panels_in(tiles):
        together = native.panel_rows(x, laid, 40, b, residual)
        for row in range(rows):
            alone = native.panel_rows(x[row : row + 1], laid, 40, b, residual[row : row + 1])[0]
            assert torch.equal(together[row], alone)


@needs_compiler
def test_panel_rows_refuses_what_it_cannot_take():
    weight = torch.randn(8, 4)
    laid = native.panels(weight)
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 5), laid, 8)  # rows of another width
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4), laid, 8 + laid.shape[2])  # more outputs than the panels hold
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4), laid, 8, bias=torch.randn(7))
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4), laid, 8, plus=torch.randn(3, 8))
    with pytest.raises(ValueError, match="all fp32, or all bf16"):
        native.panel_rows(torch.randn(2, 4).bfloat16(), laid, 8)
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4), laid[..., None], 8)  # panels of another layout
    with pytest.raises(ValueError, match="panels"):
        native.panels(weight.half())


@needs_compiler
def test_few_rows_refuses_what_it_cannot_take():
    weight = torch.randn(8, 4).bfloat16()
    with pytest.raises(ValueError, match="few_rows"):
        native.few_rows(torch.randn(native.FEW_ROWS + 1, 4), weight, None, torch.empty(native.FEW_ROWS + 1, 8))
    with pytest.raises(ValueError, match="few_rows"):
        native.few_rows(torch.randn(2, 4), weight, None, torch.empty(2, 7))
    with pytest.raises(ValueError, match="few_rows"):
        native.few_rows(torch.randn(2, 5), weight, None, torch.empty(2, 8))
    with pytest.raises(ValueError, match="few_rows"):
        native.few_rows(torch.randn(2, 4), weight, torch.randn(7), torch.empty(2, 8))
    with pytest.raises(ValueError, match="all must be one of"):
        native.few_rows(torch.randn(2, 4), weight, None, torch.empty(2, 8))  # fp32 out of a bf16 layer
    with pytest.raises(ValueError, match="takes bf16 layers"):
        native.few_rows(torch.randn(2, 4), weight.float(), None, torch.empty(2, 8))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [576, 100])  # 100: a last partial vector of 32 pairs
@pytest.mark.parametrize("rows_dtype", DTYPES)
def test_few_rows_of_a_bf16_layer_sum_in_fp32_and_round_once(rows, bias, in_features, rows_dtype):
    """A bf16 model's weights, bias and output: the fp32 sum of the products (exact in fp32), plus the bias,
    rounded once to bf16. Rows of either dtype are widened, fp32 rows not rounded to bf16 on the way."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(1000, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).to(rows_dtype)
    b = torch.randn(1000, generator=generator).bfloat16() if bias else None
    out = torch.full((rows, 1003), float("nan"), dtype=torch.bfloat16)  # columns of a wider output
    native.few_rows(x, weight, b, out[:, 1:1001])
    _assert_bf16_product(out[:, 1:1001], x, weight, b)
    assert out[:, 0].isnan().all() and out[:, -2:].isnan().all()  # nothing written outside its columns


@needs_compiler
@torch.inference_mode()
def test_without_the_bf16_dot_product_a_few_bf16_rows_run_the_kernel_once_per_projection(monkeypatch):
    monkeypatch.setattr(native, "panels_take", lambda dtype: dtype == torch.float32)  # as without AVX512-BF16
    layers = [nn.Linear(24, 32, bias=False, dtype=torch.bfloat16), nn.Linear(24, 8, dtype=torch.bfloat16),
              nn.Linear(24, 8, bias=False, dtype=torch.bfloat16)]
    calls = []
    kernel = native.few_rows
    monkeypatch.setattr(native, "few_rows", lambda *args: calls.append(args) or kernel(*args))
    for rows in range(1, native.FEW_ROWS + 1):
        x = torch.randn(rows, 24, dtype=torch.bfloat16)
        got = linear(x, *layers)
        assert len(calls) == 3 * rows
        _assert_matches(got, torch.cat([layer(x) for layer in layers], -1))
    linear(torch.randn(native.FEW_ROWS + 1, 24, dtype=torch.bfloat16), *layers)  # more rows: oneDNN's product
    assert len(calls) == 3 * native.FEW_ROWS


@needs_compiler
@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
def test_up_to_panel_rows_through_stacked_projections_run_one_panel_product(monkeypatch, dtype):
    if not native.panels_take(dtype):
        pytest.skip(f"no panels of {dtype} on this CPU")
    layers = [nn.Linear(24, 32, bias=False, dtype=dtype), nn.Linear(24, 8, dtype=dtype),
              nn.Linear(24, 8, bias=False, dtype=dtype)]
    calls = []
    kernel = native.panel_rows
    monkeypatch.setattr(native, "panel_rows", lambda *args: calls.append(args) or kernel(*args))
    most = 40  # the library's own limit (1024 or 256) is pinned by the fewer-instructions test; this one by linear
    monkeypatch.setattr(native, "most_panel_rows", lambda dtype: most)
    for count, rows in enumerate((1, 16, most), start=1):
        x = torch.randn(rows, 24, dtype=dtype)
        got = linear(x, *layers)
        assert len(calls) == count
        _assert_matches(got, torch.cat([layer(x) for layer in layers], -1))
    linear(torch.randn(most + 1, 24, dtype=dtype), *layers)  # more rows: oneDNN's product
    assert len(calls) == 3


@needs_compiler
def test_the_library_says_whether_the_cpu_has_amx_bf16():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    flags = {flag for line in cpuinfo.read_text().splitlines() if line.startswith("flags")
             for flag in line.split(":", 1)[1].split()}
    assert bool(native.library().has_amx_bf16()) == ("amx_bf16" in flags)
    assert native.bf16_in_amx() == ("amx_bf16" in flags)


@needs_compiler
@pytest.mark.parametrize("granted", [True, False])
def test_where_the_cpu_has_amx_bf16_takes_panels_up_to_a_few_rows_only(monkeypatch, granted):
    """oneDNN's bf16 product in AMX tiles outruns the panels past a few rows: the panels' own tiles where Linux
    grants them, fewer in vdpbf16ps where it does not; fp32 takes any rows in panels with AVX-512 there."""
    built = native._built(native.library())
    routed_as_if_amx_bf16(monkeypatch, True)
    monkeypatch.setattr(native, "_amx_permitted", lambda: granted)
    most = native.AMX_BF16_PANEL_ROWS if granted else native.VECTOR_BF16_PANEL_ROWS
    assert native.most_panel_rows(torch.bfloat16) == most
    assert native.most_panel_rows(torch.float32) == (native.ANY_ROWS if built.avx512 else built.most_rows)
    if native.panels_take(torch.bfloat16):
        layer = nn.Linear(24, 40, dtype=torch.bfloat16)
        assert route(torch.randn(most, 24, dtype=torch.bfloat16), layer) == "panels"
        assert route(torch.randn(most + 1, 24, dtype=torch.bfloat16), layer) == "onednn-packed"
    routed_as_if_amx_bf16(monkeypatch, False)
    assert native.most_panel_rows(torch.bfloat16) == built.most_rows
    # fp32 past 2048 rows: oneDNN on a Zen 4, where the panels' products lose more than the resolved calls save
    assert native.most_panel_rows(torch.float32) == (
        native.FP32_PANEL_ROWS_WITHOUT_AMX if built.avx512 else built.most_rows)


def _reference_attention(q, keys, values, positions, lengths, q_pos, window, scale):
    """Masked softmax attention in float64, written out: the definition the kernel must meet."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        rows = positions[s, : lengths[s]]
        visible = rows <= q_pos[s]
        if window is not None:
            visible &= rows > q_pos[s] - window
        if not visible.any():
            continue
        k, v = keys[s, :, : lengths[s]].double(), values[s, :, : lengths[s]].double()
        scores = torch.einsum("hgd,hld->hgl", q[s].double(), k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[s] = torch.einsum("hgl,hld->hgd", probs, v)
    return out


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("groups, dim", [(3, 64), (4, 128), (2, 16), (1, 8)])  # specialised and general
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_masked_softmax_attention(threads, groups, dim, window, kv_dtype):
    """Keys and values in fp32 or bf16 (the reference reads the same bf16 values, widened), fp32 queries."""
    generator = torch.Generator().manual_seed(groups * dim)
    seqs, heads, capacity = 4, 2, 40
    # a pool's layout: [slots, heads, capacity, dim] with room left over, one sequence's rows out of order
    keys = torch.randn(seqs + 1, heads, capacity, dim, generator=generator)[1:].to(kv_dtype)
    values = torch.randn(seqs + 1, heads, capacity, dim, generator=generator)[1:].to(kv_dtype)
    positions = torch.arange(capacity).repeat(seqs, 1)
    positions[2, :30] = torch.randperm(30, generator=generator)
    lengths = torch.tensor([1, 17, 30, 33])
    q_pos = torch.tensor([0, 16, 20, 40])  # the third sees only the rows placed before position 21
    q = torch.randn(seqs, heads, groups, dim, generator=generator)
    with _threads(threads):
        got = native.decode_attention(q, keys, values, positions, lengths, q_pos, window, 0.3)
    expected = _reference_attention(q, keys, values, positions, lengths, q_pos, window, 0.3)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_in_rows", [False, True])
@pytest.mark.parametrize("seqs, heads, lengths, q_pos", [
    (1, 3, [300], [299]),  # one sequence: its 3 heads' rows cut in parts for 2 or 4 threads
    (3, 1, [520, 300, 0], [519, 150, 0]),  # parts of which some see no key (the window, q_pos 150), an empty one
    (2, 3, [520, 7], [519, 6]),  # several sequences of several heads
    (1, 2, [300], [299]),  # a number of heads the kernel has no constant for
])
def test_decode_attention_in_parts_equals_masked_softmax_attention(threads, window, kv_dtype, seqs, heads, lengths,
                                                                    q_pos, heads_in_rows):
    """Where the threads outnumber the tasks or do not divide them, each task's rows are attended in parts and
    combined: the same attention as the reference's, a part with no visible key adding nothing. The KV laid out
    as a pool holds it (each head's rows contiguous) or as a cache does (each row's heads side by side, then all
    of a sequence's heads are one task)."""
    generator = torch.Generator().manual_seed(seqs * heads)
    capacity, groups, dim = 544, 3, 64
    shape = (seqs, capacity, heads, dim) if heads_in_rows else (seqs, heads, capacity, dim)
    keys, values = (torch.randn(shape, generator=generator).to(kv_dtype) for _ in range(2))
    if heads_in_rows:
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    positions = torch.arange(capacity).repeat(seqs, 1)
    positions[0, :300] = torch.randperm(300, generator=generator)  # the window's keys scattered over the parts
    q = torch.randn(seqs, heads, groups, dim, generator=generator)
    lengths, q_pos = torch.tensor(lengths), torch.tensor(q_pos)
    with _threads(threads):
        got = native.decode_attention(q, keys, values, positions, lengths, q_pos, window, 0.125)
    expected = _reference_attention(q, keys, values, positions, lengths, q_pos, window, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


@needs_compiler
def test_decode_attention_cuts_heads_into_parts_only_where_the_threads_would_share_them_unevenly():
    parts = native.decode_attention_parts
    assert parts(3, 512, 2) == 2  # one sequence of SmolLM2's 3 KV heads: 3 parts a thread
    assert parts(3, 512, 4) == 4 and parts(6, 512, 4) == 2 and parts(1, 4096, 2) == 2
    assert parts(4, 512, 2) == 1 and parts(48, 4096, 2) == 1  # a batch's tasks already even
    assert parts(3, 200, 2) == 1 and parts(3, 512, 8) == 4  # no part of fewer than 128 rows
    assert parts(1, 512, 2) == 2 and parts(2, 512, 2) == 1  # a sequence's heads in its rows: one task a sequence


@needs_compiler
def test_decode_attention_gives_zeros_where_no_key_is_visible():
    q, keys = torch.randn(2, 1, 3, 64), torch.randn(2, 1, 8, 64)
    positions = torch.arange(8).repeat(2, 1)
    got = native.decode_attention(q, keys, keys.clone(), positions, torch.tensor([8, 0]), torch.tensor([7, 7]), 1,
                                  0.125)
    assert got[1].eq(0).all() and got[0].ne(0).any()


@needs_compiler
def test_decode_attention_refuses_rows_it_does_not_have():
    q, keys = torch.randn(1, 1, 3, 64), torch.randn(1, 1, 8, 64)
    with pytest.raises(ValueError, match="up to 9 rows"):
        native.decode_attention(q, keys, keys, torch.arange(9)[None], torch.tensor([9]), torch.tensor([8]), None, 1.0)
    with pytest.raises(ValueError, match="must be int64"):
        native.decode_attention(q, keys, keys, torch.arange(8)[None], torch.tensor([8], dtype=torch.int32),
                                torch.tensor([8]), None, 1.0)
    with pytest.raises(ValueError, match="heads of 64"):
        native.decode_attention(q, keys[..., :32], keys[..., :32], torch.arange(8)[None], torch.tensor([8]),
                                torch.tensor([8]), None, 1.0)
    with pytest.raises(ValueError, match="share a layout"):
        native.decode_attention(q, keys, keys.transpose(2, 3).contiguous().transpose(2, 3), torch.arange(8)[None],
                                torch.tensor([8]), torch.tensor([8]), None, 1.0)
    for keys_as, values_as in [(torch.float16, torch.float16), (torch.bfloat16, torch.float32)]:
        with pytest.raises(ValueError, match="dtype"):
            native.decode_attention(q, keys.to(keys_as), keys.to(values_as), torch.arange(8)[None], torch.tensor([8]),
                                    torch.tensor([8]), None, 1.0)


@needs_compiler
def test_decode_attention_returns_the_queries_dtype():
    """A bf16 model's query gets a bf16 answer, summed in fp32 and rounded once: the fp32 result of the same
    inputs, rounded."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 3, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(2, 1, 20, 64, generator=generator).bfloat16() for _ in range(2))
    args = (torch.arange(20).repeat(2, 1), torch.tensor([20, 11]), torch.tensor([19, 10]), None, 0.125)
    got = native.decode_attention(q, keys, values, *args)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, native.decode_attention(q.float(), keys, values, *args).bfloat16())


def _count_calls(monkeypatch, *names: str) -> dict[str, int]:
    """Calls of the named kernels of native.c from here on, by name (each still runs), whether through native.py's
    functions or a step's resolved calls (kvreuse.model.resolved_step)."""
    calls, lib = dict.fromkeys(names, 0), native.library()

    class Counting:
        def __getattr__(self, name: str):
            kernel = getattr(lib, name)
            if name not in calls:
                return kernel

            def counted(*args):
                calls[name] += 1
                return kernel(*args)

            return counted

    counting = Counting()
    monkeypatch.setattr(native, "library", lambda: counting)
    return calls


@needs_compiler
def test_one_query_attends_in_the_decoding_kernel_and_several_in_the_prefill_kernel(monkeypatch):
    from kvreuse.model.attention import attend

    calls = _count_calls(monkeypatch, "decode_attention", "prefill_attention")
    # as on CPUs without AMX-BF16 (with it, bf16 queries take torch's fused calls: tests/model/test_attention.py)
    routed_as_if_amx_bf16(monkeypatch, False)
    keys, values = torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    positions = torch.arange(10)
    attend(torch.randn(1, 4, 16), positions[-1:], keys, values, positions, None, 0.25)
    assert calls == {"decode_attention": 1, "prefill_attention": 0}
    attend(torch.randn(3, 4, 16), positions[-3:], keys, values, positions, None, 0.25)
    assert calls == {"decode_attention": 1, "prefill_attention": 1}
    attend(torch.randn(1, 4, 16).bfloat16(), positions[-1:], keys.bfloat16(), values.bfloat16(), positions, None, 0.25)
    assert calls == {"decode_attention": 2, "prefill_attention": 1}  # one bf16 query reads bf16 KV in the kernel
    attend(torch.randn(3, 4, 16).bfloat16(), positions[-3:], keys.bfloat16(), values.bfloat16(), positions, None, 0.25)
    assert calls == {"decode_attention": 2, "prefill_attention": 2}  # bf16 queries too
    attend(torch.randn(3, 4, 12), positions[-3:], keys[..., :12], values[..., :12], positions, None, 0.25)
    assert calls == {"decode_attention": 2, "prefill_attention": 2}  # heads not whole vectors: torch's


def _reference_prefill(q, q_pos, keys, values, k_pos, window, scale) -> torch.Tensor:
    """fp64 softmax attention with the mask by position; zeros for a query that sees no key."""
    visible = attention_mask(q_pos, k_pos, window)
    groups = q.shape[1] // keys.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (keys, values))
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num()
    return torch.einsum("hnm,mhd->nhd", probs, v).reshape(q.shape[0], -1)


def _prefill_layouts(generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(query positions, key positions): a prompt; rows scattered over it and a final run (a fusion plan's); both
    sides out of order (a plan's rows are slots); a query before every key."""
    prompt = torch.arange(203)
    scattered = torch.cat([torch.randperm(150, generator=generator)[:23].sort().values, torch.arange(180, 203)])
    shuffled = torch.randperm(203, generator=generator)
    return {"prompt": (prompt, prompt), "scattered": (scattered, prompt),
            "out of order": (shuffled[:50], shuffled), "blind": (torch.tensor([0, 100, 202]), prompt + 1)}


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, groups, dim", [(3, 3, 64), (2, 1, 16), (1, 4, 256), (2, 8, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_prefill_attention_equals_masked_softmax_attention(threads, heads, groups, dim, window):
    generator = torch.Generator().manual_seed(heads * groups * dim)
    scale = dim**-0.5
    for layout, (q_pos, k_pos) in _prefill_layouts(generator).items():
        # a cache's layout: rows of [heads, dim] with room for more heads' worth of rows (any row stride)
        cache = torch.randn(k_pos.numel(), 2, heads + 1, dim, generator=generator)
        keys, values = cache[:, 0, :heads], cache[:, 1, :heads]
        q = torch.randn(q_pos.numel(), heads * groups, dim, generator=generator)
        with _threads(threads):
            got = native.prefill_attention(q, q_pos, keys.contiguous(), values.contiguous(), k_pos, window, scale)
        expected = _reference_prefill(q, q_pos, keys, values, k_pos, window, scale)
        torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5, msg=lambda m: f"{layout}: {m}")
        if layout == "blind":
            assert got[0].eq(0).all()


needs_amx = pytest.mark.skipif(not (native.available() and native.bf16_in_amx() and native._amx_permitted()),
                               reason="bf16 attention in AMX tiles needs a CPU with AMX-BF16")


def _amx_layouts(generator: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    """(query positions, keys): prompts and continuations cut anywhere by query blocks of 16 and key blocks of 32;
    a plan's rows scattered with a final run; rows out of order; the first row alone."""
    scattered = torch.cat([torch.randperm(150, generator=generator)[:23].sort().values, torch.arange(180, 203)])
    return {"prompt": (torch.arange(203), 203), "continuation": (torch.arange(48, 64), 64),
            "long-continuation": (torch.arange(230, 300), 300), "last": (torch.tensor([32]), 33),
            "one-block": (torch.arange(33), 33), "scattered": (scattered, 203),
            "shuffled": (torch.randperm(203, generator=generator)[:90], 203), "first": (torch.tensor([0]), 40)}


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, groups", [(3, 3), (2, 1), (1, 4)])
def test_bf16_attention_in_amx_tiles_rounds_only_its_weights_and_its_output(threads, heads, groups):
    """bf16 queries at any of the keys' positions over the keys at or before them, in AMX tiles: as the native
    prefill kernel, exact products summed in fp32, weights rounded for the values' product, the output once; keys
    read in place at a cache's row stride."""
    generator = torch.Generator().manual_seed(heads * groups)
    for layout, (q_pos, m) in _amx_layouts(generator).items():
        cache = torch.randn(m, 2, heads + 1, 64, generator=generator).bfloat16()
        keys, values = cache[:, 0, :heads], cache[:, 1, :heads]
        q = torch.randn(q_pos.numel(), heads * groups, 64, generator=generator).bfloat16() * 2
        positions = torch.arange(m)
        with _threads(threads):
            got = native.amx_causal_attention(q, q_pos, keys, values, 0.125)
        assert got.dtype == torch.bfloat16
        error = (got.double() - _reference_prefill(q, q_pos, keys, values, positions, None, 0.125)).abs()
        assert error.max() < 2e-2 and error.mean() < 2e-3, (layout, error.max(), error.mean())


@needs_amx
def test_attention_in_amx_tiles_refuses_what_it_cannot_take():
    keys, q, q_pos = torch.randn(40, 3, 64).bfloat16(), torch.randn(8, 9, 64).bfloat16(), torch.arange(32, 40)
    with pytest.raises(ValueError, match="amx_causal_attention"):
        native.amx_causal_attention(q, q_pos, keys.float(), keys.float(), 0.125)
    with pytest.raises(ValueError, match="amx_causal_attention"):
        native.amx_causal_attention(q[..., :32], q_pos, keys[..., :32], keys[..., :32], 0.125)
    for positions in (q_pos + 1, q_pos - 33, q_pos[:7], q_pos.int()):  # past the keys, before them, too few, int32
        with pytest.raises(ValueError, match="int64 positions"):
            native.amx_causal_attention(q, positions, keys, keys, 0.125)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("heads, groups, dim", [(3, 3, 64), (2, 1, 16), (1, 4, 256), (2, 8, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_prefill_attention_rounds_only_its_weights_and_its_output(threads, heads, groups, dim, window):
    """bf16 queries, keys and values (multiplied in the bf16 dot-product instruction here, with AVX512-BF16):
    scores exact up to fp32 summation, the weights rounded to bf16 for the product with the values, the output
    rounded once. Against fp64 attention of the same bf16 inputs that is
    about the output's own rounding (mean 8e-4 here); torch's bf16 products, which round the scores too, are
    three times as far, and a key masked wrongly moves an output by tenths."""
    generator = torch.Generator().manual_seed(heads * groups * dim)
    for layout, (q_pos, k_pos) in _prefill_layouts(generator).items():
        cache = torch.randn(k_pos.numel(), 2, heads + 1, dim, generator=generator).bfloat16()
        keys, values = cache[:, 0, :heads], cache[:, 1, :heads]  # read in place, at the cache's row stride
        q = torch.randn(q_pos.numel(), heads * groups, dim, generator=generator).bfloat16()
        with _threads(threads):
            got = native.prefill_attention(q, q_pos, keys, values, k_pos, window, dim**-0.5)
        assert got.dtype == torch.bfloat16
        error = (got.double() - _reference_prefill(q, q_pos, keys, values, k_pos, window, dim**-0.5)).abs()
        assert error.max() < 2e-2 and error.mean() < 2e-3, (layout, error.max(), error.mean())
        if layout == "blind":
            assert got[0].eq(0).all()


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_never_reads_scratch_it_has_not_written(monkeypatch, dtype):
    """The kernel's scratch comes uninitialised. Filled with NaN instead, it changes nothing: the tiles past the
    last key are zeros the kernel wrote, not whatever the memory held (a masked weight of 0 times a NaN is a NaN)."""
    generator = torch.Generator().manual_seed(5)
    q_pos, k_pos = torch.arange(60, 203), torch.arange(203)  # 203 keys: the last tile is partly past them
    keys, values = torch.randn(2, 203, 3, 64, generator=generator).to(dtype)
    q = torch.randn(q_pos.numel(), 9, 64, generator=generator).to(dtype)
    clean = native.prefill_attention(q, q_pos, keys, values, k_pos, None, 0.125)
    monkeypatch.setattr(native, "_scratch", lambda nbytes: torch.full((nbytes,), 255, dtype=torch.uint8))
    assert torch.equal(native.prefill_attention(q, q_pos, keys, values, k_pos, None, 0.125), clean)


@needs_compiler
@pytest.mark.parametrize("step", [0.05, 0.5, 3.0])
def test_prefill_attention_follows_a_maximum_that_keeps_growing(step):
    """Each key scores `step` above the one before it, so a row's maximum moves on at every tile (step 3), every
    few tiles (0.5, past the kernel's headroom) or never after the first (0.05): the softmax must rescale what it
    summed before each move."""
    m, dim = 300, 64
    keys = (torch.arange(m, dtype=torch.float32) * step)[:, None, None].expand(m, 1, dim).contiguous() / dim
    values = torch.randn(m, 1, dim, generator=torch.Generator().manual_seed(1))
    q = torch.ones(40, 3, dim)
    positions = torch.arange(m)
    q_pos = torch.randperm(m, generator=torch.Generator().manual_seed(2))[:40]
    got = native.prefill_attention(q, q_pos, keys, values, positions, None, 1.0)
    expected = _reference_prefill(q, q_pos, keys, values, positions, None, 1.0)
    # scores up to 15 (step 0.05) round to ~1e-6 in fp32: torch's fp32 kernel is off by 3.5e-6 there too
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("flag", ["-mno-avx512f", "-mno-avx512bf16"])
def test_prefill_attention_is_exact_on_cpus_with_fewer_instructions(tmp_path, monkeypatch, flag):
    """Built without AVX-512 (vectors of 8 floats, as on an AVX2 machine) or without AVX512-BF16, the kernel gives
    the same fp32 results, and takes bf16 widened to fp32: within the output's own rounding of fp64 attention."""
    # without AVX512-BF16 the vectors stay as wide as this CPU's (8 floats on an AVX2-only one, a Zen 3 EPYC)
    width = 8 if flag == "-mno-avx512f" else native.library().prefill_attention_vector_width()
    monkeypatch.setattr(native, "COMPILE_FLAGS", [*native.COMPILE_FLAGS, flag])
    monkeypatch.setattr(native, "cache_root", lambda: tmp_path)
    native.library.cache_clear()
    try:
        assert native.library().prefill_attention_vector_width() == width
        assert not native.library().has_bf16_dot()  # no bf16 dot-product instruction built
        assert native.library().panel_width() == 2 * width
        assert native.library().panel_rows_most() == (1024 if width == 16 else 2048)  # AVX2: its assembly tile
        weight, x = torch.randn(40, 24), torch.randn(11, 24)
        torch.testing.assert_close(native.panel_rows(x, native.panels(weight), 40), x @ weight.T, atol=1e-5, rtol=1e-5)
        generator = torch.Generator().manual_seed(8)
        for q_pos, k_pos in _prefill_layouts(generator).values():
            keys, values = torch.randn(2, k_pos.numel(), 3, 64, generator=generator)
            q = torch.randn(q_pos.numel(), 9, 64, generator=generator)
            got = native.prefill_attention(q, q_pos, keys, values, k_pos, 37, 0.125)
            expected = _reference_prefill(q, q_pos, keys, values, k_pos, 37, 0.125)
            torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
            q, keys, values = q.bfloat16(), keys.bfloat16(), values.bfloat16()
            got = native.prefill_attention(q, q_pos, keys, values, k_pos, 37, 0.125)
            assert got.dtype == torch.bfloat16
            exact = _reference_prefill(q, q_pos, keys, values, k_pos, 37, 0.125)
            _assert_matches(got, exact.bfloat16())
    finally:
        native.library.cache_clear()


@needs_compiler
def test_prefill_attention_reads_a_cache_in_place():
    """Keys and values as the cache holds them (rows of the layer's heads, any row stride), queries as strided
    views: the same result as from contiguous copies."""
    cache = torch.randn(130, 2, 3, 64)
    keys, values = cache[:, 0], cache[:, 1]
    q = torch.randn(40, 2, 9, 64)[:, 1]
    positions = torch.arange(130)
    got = native.prefill_attention(q, positions[-40:], keys, values, positions, None, 0.125)
    torch.testing.assert_close(got, native.prefill_attention(q.contiguous(), positions[-40:], keys.contiguous(),
                                                             values.contiguous(), positions, None, 0.125))


@needs_compiler
def test_prefill_attention_refuses_what_it_cannot_take():
    q, keys, positions = torch.randn(4, 6, 64), torch.randn(8, 2, 64), torch.arange(8)
    with pytest.raises(ValueError, match="int64 positions"):
        native.prefill_attention(q, positions[:4].int(), keys, keys, positions, None, 1.0)
    with pytest.raises(ValueError, match="int64 positions"):
        native.prefill_attention(q, positions[:4], keys, keys, positions[:7], None, 1.0)
    with pytest.raises(ValueError, match="share a layout"):
        native.prefill_attention(q, positions[:4], keys, keys.transpose(0, 1).contiguous().transpose(0, 1), positions,
                                 None, 1.0)
    with pytest.raises(ValueError, match="divide the queries"):
        native.prefill_attention(torch.randn(4, 5, 64), positions[:4], keys, keys, positions, None, 1.0)
    with pytest.raises(ValueError, match="all one of"):
        native.prefill_attention(q.bfloat16(), positions[:4], keys, keys, positions, None, 1.0)  # mixed
    with pytest.raises(ValueError, match="all one of"):
        native.prefill_attention(q.half(), positions[:4], keys.half(), keys.half(), positions, None, 1.0)
    with pytest.raises(ValueError, match="whole vectors"):
        narrow = keys[..., :12].contiguous()
        native.prefill_attention(q[..., :12], positions[:4], narrow, narrow, positions, None, 1.0)


@needs_compiler
def test_a_pooled_decoding_step_attends_in_the_kernel_once_per_layer_with_no_mask(tiny_model, monkeypatch):
    from kvreuse.model.resolved_step import OneQueryEach
    from kvreuse.model.kv_pool import KVPool
    from tests.conftest import random_ids

    pool = KVPool.for_model(tiny_model, 3, 1 << 30)
    pooled = [pool.adopt(tiny_model.prefill(random_ids(n, seed=n)).cache, capacity=40) for n in (6, 11)]
    calls, steps = [], []  # the sequences of each attention call, from the general step or the resolved one
    kernel, resolved, step_of = native.decode_attention, OneQueryEach.attend, pool.step_of
    monkeypatch.setattr(native, "decode_attention", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    monkeypatch.setattr(OneQueryEach, "attend", lambda self, *args: calls.append(self.sequences)
                        or resolved(self, *args))
    monkeypatch.setattr(pool, "step_of", lambda *args: steps.append(step_of(*args)) or steps[-1])
    tiny_model.decode_batch([7, 8], pooled)
    assert len(calls) == tiny_model.num_layers and calls[0] == 2
    assert steps[0].masks == {}


@needs_compiler
def test_the_runtime_builds_the_kernels_when_it_loads(make_tiny):
    from kvreuse.model.runtime import LayerwiseModel

    native.library.cache_clear()
    LayerwiseModel(make_tiny("llama"))
    assert native.library.cache_info().currsize == 1


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_llamas_module(threads, rows, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96)
    norm.to(dtype)
    x = torch.randn(rows, 2, 96)[:, 1] * 3  # rows of a wider tensor
    x[0] *= 1e-3  # a row whose mean square is about eps: eps must count
    x = x.to(dtype)
    with _threads(threads):
        got = native.rms_norm(x, norm.weight, norm.variance_epsilon)
    _assert_matches(got, norm(x))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_torch_on_the_halves_of_one_product(rows, dtype):
    product = torch.randn(rows, 2 * 300) * 8
    product[0, :4] = torch.tensor([-100.0, 100.0, -89.0, 0.0])  # e^-g past fp32's range on either side
    gate, up = product.to(dtype).split(300, -1)
    got = native.silu_mul(gate, up)
    _assert_matches(got, torch.nn.functional.silu(gate) * up)
    assert got[0, :4].isfinite().all()


def _panel_dtypes() -> list[torch.dtype]:
    return [d for d in DTYPES if native.panels_take(d)]


def _panel_kinds() -> list[tuple[torch.dtype, bool]]:
    """(rows' dtype, int8 weights) of every product in panels the kernels run."""
    return [(d, False) for d in _panel_dtypes()] + [(torch.float32, True)]


def _kind_id(kind: tuple[torch.dtype, bool]) -> str:
    return "fp32 over int8" if kind[1] else str(kind[0]).removeprefix("torch.")


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", _panel_kinds(), ids=_kind_id)
def test_normed_panel_rows_are_the_norm_then_the_product_to_the_bit(threads, rows, bias, kind):
    dtype, int8 = kind
    x = (torch.randn(rows, 2, 96)[:, 1] * 3).to(dtype)  # rows of a wider tensor
    norm_weight, weight = torch.randn(96).to(dtype), torch.randn(72, 96).to(dtype)
    b = torch.randn(72).to(dtype) if bias else None
    laid = native.Panels.of(weight, b, int8=int8)
    with _threads(threads):
        got = native.normed_panel_rows(x, norm_weight, 1e-5, laid)
        apart = native.panel_rows(native.rms_norm(x, norm_weight, 1e-5), laid.panels, 72, b)
    assert torch.equal(got, apart)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 4, 13, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", _panel_kinds(), ids=_kind_id)
@pytest.mark.parametrize("intermediate", [96, 72])  # whole panels (gate and up taken as their tiles come), or not
def test_layer_end_is_its_kernels_one_after_another_to_the_bit(threads, rows, bias, kind, intermediate):
    """h = attn @ o + residual, then h + down(silu(gate) * up) of norm(h): each step's kernel, in one call."""
    dtype, int8 = kind
    hidden, attn_width = 64, 96
    attn, residual = (torch.randn(rows, width).to(dtype) for width in (attn_width, hidden))
    weights = {name: torch.randn(shape).to(dtype) / 4 for name, shape in
               (("o", (hidden, attn_width)), ("gate_up", (2 * intermediate, hidden)), ("down", (hidden, intermediate)))}
    biases = {name: torch.randn(w.shape[0]).to(dtype) if bias else None for name, w in weights.items()}
    laid = {name: native.Panels.of(w, biases[name], int8=int8) for name, w in weights.items()}
    norm_weight = torch.randn(hidden).to(dtype)
    with _threads(threads):
        got = native.layer_end(attn, residual, laid["o"], norm_weight, 1e-5, laid["gate_up"], laid["down"])
        h = native.panel_rows(attn, laid["o"].panels, hidden, biases["o"], residual)
        gate, up = native.panel_rows(native.rms_norm(h, norm_weight, 1e-5), laid["gate_up"].panels, 2 * intermediate,
                                     biases["gate_up"]).split(intermediate, -1)
        apart = native.panel_rows(native.silu_mul(gate, up), laid["down"].panels, hidden, biases["down"], h)
    assert torch.equal(got, apart)


@needs_compiler
@pytest.mark.skipif(not keep_freed_memory(), reason="not glibc")
def test_layer_end_of_a_full_mlp_pass_reuses_freed_memory_without_faulting_pages_in():
    """Its working rows for as many rows as one MLP pass takes (SmolLM2's widths: 2048 rows, 47 MB in all) come back
    from the heap on the next call: joined into one buffer they were mapped afresh at every layer of a prefill."""
    hidden, intermediate = 576, 1536
    rows = MLP_PASS_BYTES // (2 * intermediate * 4)
    weights = {"o": (hidden, hidden), "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
    laid = {name: native.Panels.of(torch.randn(shape) / 32) for name, shape in weights.items()}
    attn, residual, norm_weight = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.ones(hidden)

    def faults_of_a_call() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        native.layer_end(attn, residual, laid["o"], norm_weight, 1e-5, laid["gate_up"], laid["down"])
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_a_call()
    working_pages = rows * (2 * hidden + 3 * intermediate) * 4 // 4096
    # the fewest of a few calls: what earlier tests left on the heap may cost one call some faults, never all
    assert min(faults_of_a_call() for _ in range(3)) < working_pages // 20


@needs_compiler
def test_a_layers_parts_in_one_call_refuse_what_they_cannot_take():
    # a layer of 8 hidden values, 16 query values and 16 intermediate ones
    o_proj = native.Panels.of(torch.randn(8, 16))
    gate_up = native.Panels.of(torch.randn(32, 8))
    down = native.Panels.of(torch.randn(8, 16))
    attn, residual, norm = torch.randn(2, 16), torch.randn(2, 8), torch.ones(8)
    assert native.layer_end(attn, residual, o_proj, norm, 1e-5, gate_up, down).shape == (2, 8)
    with pytest.raises(ValueError, match="layer_end"):  # a residual of another width
        native.layer_end(attn, torch.randn(2, 9), o_proj, norm, 1e-5, gate_up, down)
    with pytest.raises(ValueError, match="layer_end"):  # rows that are a transposed view
        native.layer_end(torch.randn(16, 2).T, residual, o_proj, norm, 1e-5, gate_up, down)
    with pytest.raises(ValueError, match="layer_end"):  # a down product that does not take 16 values
        native.layer_end(attn, residual, o_proj, norm, 1e-5, gate_up,
                         native.Panels.of(torch.randn(8, 12)))
    with pytest.raises(ValueError, match="layer_end"):  # a norm of another dtype
        native.layer_end(attn, residual, o_proj, norm.double(), 1e-5, gate_up, down)
    with pytest.raises(ValueError, match="normed_panel_rows"):  # rows of another width than the weight's
        native.normed_panel_rows(torch.randn(2, 12), torch.ones(12), 1e-5, o_proj)
    with pytest.raises(ValueError, match="normed_panel_rows"):  # a norm of another width than the rows'
        native.normed_panel_rows(attn, torch.ones(15), 1e-5, o_proj)
    with pytest.raises(ValueError, match="Panels"):  # panels that are not those of the weight it names
        native.Panels(o_proj.panels, 12, 8)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_equals_the_rotation_by_halves_into_rows_of_another_tensor(dtype):
    """The rotation as torch's ops compute it by halves (the runtime's way without the kernel): in bf16, x * cos
    is rounded before the other half's product is added to it."""
    x = torch.randn(30, 12, 16)[:, 3:9].to(dtype)  # the k of a q/k/v product: heads side by side, a wider row
    angles = torch.randn(30, 8)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    cache = torch.zeros(50, 6, 16, dtype=dtype)
    native.rope(x, cos, sin, out=cache[10:40])
    rotated = x * cos[:, None]
    rotated[..., :8].addcmul_(x[..., 8:], sin[:, None, :8], value=-1)
    rotated[..., 8:].addcmul_(x[..., :8], sin[:, None, 8:])
    _assert_matches(cache[10:40], rotated)
    assert cache[:10].eq(0).all() and cache[40:].eq(0).all()
    _assert_matches(native.rope(x, cos, sin), rotated)


def _place_one_layer(keys, values, cos, sin, rows, cache_keys, cache_values, picks=None):
    """`native.place_layers` for one layer: parts [rows_p, heads, dim] into one cache layer with its tables."""
    native.place_layers([k.unsqueeze(0) for k in keys], [v.unsqueeze(0) for v in values], [cos], [sin], rows,
                        [cache_keys], [cache_values], picks)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scattered", [False, True])
def test_place_one_layer_writes_each_part_s_rows_rotated_where_rope_of_them_joined_would(dtype, scattered):
    """A layer's stored KV in parts of several sizes, placed at cache rows (a slice, or indices in any order): the
    keys as `rope` turns the joined keys, the values copied, every other cache row untouched."""
    counts = [5, 1, 12, 7]
    keys = [torch.randn(c, 3, 16).to(dtype) for c in counts]
    values = [torch.randn(c, 3, 16).to(dtype) for c in counts]
    angles = torch.randn(sum(counts), 8)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    rows = torch.randperm(40)[: sum(counts)] if scattered else slice(6, 6 + sum(counts))
    cache_keys, cache_values = torch.zeros(40, 3, 16, dtype=dtype), torch.zeros(40, 3, 16, dtype=dtype)
    _place_one_layer(keys, values, cos, sin, rows, cache_keys, cache_values)
    expected_keys, expected_values = torch.zeros_like(cache_keys), torch.zeros_like(cache_values)
    expected_keys[rows] = native.rope(torch.cat(keys), cos, sin)
    expected_values[rows] = torch.cat(values)
    assert torch.equal(cache_keys, expected_keys) and torch.equal(cache_values, expected_values)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_place_one_layer_picks_a_part_s_rows_where_told_as_a_gathered_copy_of_them_would_place(dtype):
    """Parts handed out whole with the rows to pick from them (a memory tier's layer for CacheTune's sparse rows),
    beside a part taken in order: placed as the gathered rows would be."""
    held = [torch.randn(9, 3, 16).to(dtype), torch.randn(4, 3, 16).to(dtype), torch.randn(6, 3, 16).to(dtype)]
    values = [torch.randn_like(k) for k in held]
    picks = [torch.tensor([0, 2, 3, 8]), None, torch.tensor([5, 1, 4])]
    keys, vals = ([t if p is None else t[p] for t, p in zip(parts, picks)] for parts in (held, values))
    angles = torch.randn(11, 8)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    rows = torch.randperm(30)[:11]
    gathered = [torch.zeros(30, 3, 16, dtype=dtype) for _ in range(2)]
    _place_one_layer(keys, vals, cos, sin, rows, *gathered)
    picked = [torch.zeros(30, 3, 16, dtype=dtype) for _ in range(2)]
    _place_one_layer(held, values, cos, sin, rows, *picked, picks)
    assert all(torch.equal(a, b) for a, b in zip(picked, gathered)) and gathered[0].abs().sum() > 0


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES)
def test_place_layers_places_each_layer_as_one_layer_at_a_time_would(dtype):
    """Several layers in one call: parts that are views of stored entries (layers further apart than a layer's
    rows, as a run of an entry's rows is), one picked, each layer into its own cache tensors with its own
    tables."""
    entries = [torch.randn(6, 9, 3, 16).to(dtype), torch.randn(6, 4, 3, 16).to(dtype)]
    values = [torch.randn_like(e) for e in entries]
    layers = range(1, 4)
    keys = [entries[0][layers.start : layers.stop, 2:7], entries[1][layers.start : layers.stop]]
    vals = [values[0][layers.start : layers.stop, 2:7], values[1][layers.start : layers.stop]]
    picks = [None, torch.tensor([3, 0, 2])]
    angles = torch.randn(len(layers), 8, 8)
    cos, sin = ([torch.cat([f(a)] * 2, -1).to(dtype) for a in angles] for f in (torch.cos, torch.sin))
    rows = torch.randperm(20)[:8]
    placed = [[torch.zeros(20, 3, 16, dtype=dtype) for _ in layers] for _ in range(2)]
    native.place_layers(keys, vals, cos, sin, rows, *placed, picks)
    for i in range(len(layers)):
        expected = [torch.zeros(20, 3, 16, dtype=dtype) for _ in range(2)]
        _place_one_layer([k[i] for k in keys], [v[i] for v in vals], cos[i], sin[i], rows, *expected, picks)
        assert torch.equal(placed[0][i], expected[0]) and torch.equal(placed[1][i], expected[1]), i
    assert not any(torch.equal(placed[kv][0], placed[kv][i]) for kv in range(2) for i in (1, 2))  # layers differ


@needs_compiler
def test_place_layers_refuses_layers_it_cannot_place_alike():
    keys, cos = [torch.randn(2, 4, 2, 16)], [torch.randn(4, 16)] * 2
    cache = [torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)]
    with pytest.raises(ValueError, match="2 cache layers"):
        native.place_layers(keys, keys, cos[:1], cos[:1], slice(0, 4), cache, [c.clone() for c in cache])
    with pytest.raises(ValueError, match="2 cache layers"):
        native.place_layers(keys, keys, cos, cos, slice(0, 4), [cache[0], torch.zeros(12, 2, 16)],
                            [c.clone() for c in cache])
    with pytest.raises(ValueError, match="2 cache layers"):  # a layer's rows not contiguous
        native.place_layers([torch.randn(2, 2, 4, 16).transpose(1, 2)], keys, cos, cos, slice(0, 4), cache,
                            [c.clone() for c in cache])
    assert all(c.eq(0).all() for c in cache)


@needs_compiler
@pytest.mark.parametrize("pick", [[0, 4], [-1, 2], [1, 9]])
def test_place_one_layer_refuses_picks_outside_a_part_and_writes_nothing(pick):
    keys, cos = [torch.randn(4, 2, 16), torch.randn(3, 2, 16)], torch.randn(5, 16)
    cache = torch.zeros(10, 2, 16)
    with pytest.raises(ValueError, match="picks outside"):
        _place_one_layer(keys, keys, cos, cos, slice(0, 5), cache, cache.clone(), [torch.tensor(pick), None])
    assert cache.eq(0).all()
    with pytest.raises(ValueError, match="picks as 1-d int64"):
        _place_one_layer(keys, keys, cos, cos, slice(0, 5), cache, cache.clone(), [torch.tensor([0., 1.]), None])


@needs_compiler
@pytest.mark.parametrize("rows", [slice(7, 10), slice(-3, None), slice(-5, -2)])
def test_place_one_layer_writes_the_rows_torch_s_indexing_takes_for_a_slice(rows):
    """A slice counting from the cache's end ("the last 3 rows") places where torch's indexing puts it: the kernel
    writes from the slice's start, so a start left negative wrote before the cache's memory."""
    backing = torch.zeros(2, 20, 2, 16)  # each cache layer the last 10 rows of its own: memory before it is in sight
    cache_keys, cache_values = backing[0, 10:], backing[1, 10:]
    keys, values = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    no_turn = torch.ones(3, 16), torch.zeros(3, 16)  # cos and sin of angle 0: the keys placed as they are
    _place_one_layer([keys], [values], *no_turn, rows, cache_keys, cache_values)
    expected = torch.zeros_like(backing)
    expected[0, 10:][rows], expected[1, 10:][rows] = keys, values
    assert torch.equal(backing, expected)


@needs_compiler
def test_place_one_layer_refuses_what_it_cannot_take():
    keys, cos = [torch.randn(4, 2, 16), torch.randn(3, 2, 16)], torch.randn(7, 16)
    cache = torch.zeros(10, 2, 16)
    with pytest.raises(ValueError, match="place_layers"):
        _place_one_layer(keys, keys, cos[:6], cos[:6], slice(0, 6), cache, cache.clone())
    with pytest.raises(ValueError, match="7 rows into cache rows"):
        _place_one_layer(keys, keys, cos, cos, slice(5, 12), cache, cache.clone())
    with pytest.raises(ValueError, match="7 rows into cache rows"):
        _place_one_layer(keys, keys, cos, cos, torch.tensor([0, 1, 2, 3, 4, 5, 10]), cache, cache.clone())
    with pytest.raises(ValueError, match="all must be one of"):
        _place_one_layer(keys, keys, cos, cos, slice(0, 7), cache.bfloat16(), cache.bfloat16())


@needs_compiler
def test_pointwise_kernels_refuse_what_they_cannot_take():
    x = torch.randn(4, 2, 16)
    cos = torch.randn(4, 16)
    with pytest.raises(ValueError, match="out apart from x"):
        native.rope(x, cos, cos, out=x)
    with pytest.raises(ValueError, match="rope"):
        native.rope(x, cos[:3], cos[:3])
    with pytest.raises(ValueError, match="rms_norm"):
        native.rms_norm(x[:, 0], torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="one shape and layout"):
        native.silu_mul(torch.randn(4, 8), torch.randn(4, 16)[:, :8])
    with pytest.raises(ValueError, match="all must be one of"):
        native.rms_norm(x[:, 0], torch.ones(16, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="all must be one of"):
        native.silu_mul(torch.randn(4, 8).half(), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="all must be one of"):
        native.rope(x, cos, cos, out=torch.empty(4, 2, 16, dtype=torch.bfloat16))


@needs_compiler
def test_a_llama_layer_runs_the_pointwise_kernels_and_gemmas_norms_stay_its_own(make_tiny, monkeypatch):
    from kvreuse.model.runtime import LayerwiseModel

    calls = _count_calls(monkeypatch, "rms_norm", "silu_mul", "rope", "normed_panel_rows", "layer_end")
    llama = LayerwiseModel(make_tiny("llama"))
    layers = llama.num_layers
    # Products in panels: a layer's input norm and q/k/v product in one call, its end (o-projection, norm, MLP) in
    # one; q and k are views of one product, side by side: one rotation a layer. The final norm on its own.
    in_parts = {"rms_norm": 1, "silu_mul": 0, "rope": layers, "normed_panel_rows": layers, "layer_end": layers}
    # Products elsewhere: each kernel apart.
    apart = {"rms_norm": 2 * layers + 1, "silu_mul": layers, "rope": layers, "normed_panel_rows": 0, "layer_end": 0}
    llama.prefill(torch.arange(5, 25))
    assert calls == in_parts
    calls.update(dict.fromkeys(calls, 0))
    with monkeypatch.context() as patched:
        patched.setattr(native, "most_panel_rows", lambda dtype: 0)
        llama.prefill(torch.arange(5, 25))
    assert calls == apart
    calls.update(dict.fromkeys(calls, 0))
    # bf16 too; where the CPU has AMX-BF16 only a few rows take the panels: of 40, the last layer's end (its last row)
    in_amx = {"rms_norm": 2 * layers, "silu_mul": layers - 1, "rope": layers, "normed_panel_rows": 0, "layer_end": 1}
    assert native.AMX_BF16_PANEL_ROWS < 40
    for amx, expected in ((False, in_parts), (True, in_amx)):
        with monkeypatch.context() as patched:
            routed_as_if_amx_bf16(patched, amx)
            LayerwiseModel(make_tiny("llama").bfloat16()).prefill(torch.arange(5, 45))
        assert calls == (expected if native.panels_take(torch.bfloat16) else apart), amx
        calls.update(dict.fromkeys(calls, 0))
    LayerwiseModel(make_tiny("gemma3")).prefill(torch.arange(5, 25))
    # Gemma's norms are its own (1 + weight) and it normalises q and k apart (new tensors): two rotations a layer
    assert calls == {"rms_norm": 0, "silu_mul": 0, "rope": 2 * layers, "normed_panel_rows": 0, "layer_end": 0}


@needs_compiler
def test_kernels_refuse_heads_that_do_not_lie_side_by_side_and_the_runtime_rotates_them_in_torch(tiny_model):
    """Heads strided apart within a row (a transposed view) are not the kernels' layout: refused by name, and the
    runtime's RoPE takes torch's route for them with the same result."""
    x = torch.randn(3, 5, 16).transpose(0, 1)  # [5 rows, 3 heads, 16], heads 80 floats apart
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    with pytest.raises(ValueError, match="rope"):
        native.rope(x, cos, sin)
    with pytest.raises(ValueError, match="share a layout"):
        native.prefill_attention(torch.randn(2, 6, 16), torch.arange(2), x, x, torch.arange(5), None, 1.0)
    rotary = tiny_model.rotary(torch.arange(5))
    q = torch.randn(tiny_model.num_q_heads, 5, tiny_model.head_dim).transpose(0, 1)
    torch.testing.assert_close(tiny_model.rope(0, q, rotary), tiny_model.rope(0, q.contiguous(), rotary))


@needs_compiler
def test_int8_panels_hold_each_output_s_int8_row_and_its_scale():
    weight = torch.randn(45, 13) * torch.linspace(0.1, 4, 45)[:, None]  # outputs of different ranges
    weight[7] = 0  # an output of zeros
    laid, width = native.int8_panels(weight), native.library().panel_width()
    count = -(-45 // width)
    assert laid.dtype == torch.int8 and laid.shape == (count, 13 * width + 4 * width)
    values = laid[:, : 13 * width].reshape(count, 13, width).transpose(1, 2).reshape(-1, 13).float()
    scales = laid[:, 13 * width :].contiguous().view(torch.float32).reshape(-1)
    assert values.abs().max() == 127 and torch.equal(values[45:], torch.zeros(count * width - 45, 13))
    assert torch.equal(scales[:45], torch.where(weight.abs().amax(1) > 0, weight.abs().amax(1) / 127, 1.0))
    assert torch.equal(values[:45] * scales[:45, None], native.int8_dequantized(weight))
    assert (native.int8_dequantized(weight) - weight).abs().le(scales[:45, None] / 2 + 1e-7).all()


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 40])
@pytest.mark.parametrize("shape", [(40, 33), (96, 64), (7, 1)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("plus", [False, True])
def test_panel_rows_over_int8_panels_multiply_the_int8_weights(threads, rows, shape, bias, plus):
    generator = torch.Generator().manual_seed(rows * 1000 + shape[0])
    weight, x = torch.randn(shape, generator=generator), torch.randn(rows, shape[1], generator=generator)
    b = torch.randn(shape[0], generator=generator) if bias else None
    residual = torch.randn(rows, shape[0], generator=generator) if plus else None
    with _threads(threads):
        got = native.panel_rows(x, native.int8_panels(weight), shape[0], b, residual)
    expected = x.double() @ native.int8_dequantized(weight).double().T
    expected += 0 if b is None else b.double()
    expected += 0 if residual is None else residual.double()
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_int8_panels_refuse_what_they_cannot_take():
    weight = torch.randn(8, 4)
    laid = native.int8_panels(weight)
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4).bfloat16(), laid, 8)  # int8 weights take fp32 rows
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 5), laid, 8)  # rows of another width
    with pytest.raises(ValueError, match="panel_rows"):
        native.panel_rows(torch.randn(2, 4), laid[:, :-4], 8)  # a panel without its scales
    with pytest.raises(ValueError, match="int8_panels"):
        native.int8_panels(weight.bfloat16())
    o_proj, gate_up, down = (native.Panels.of(torch.randn(shape), int8=int8)
                             for shape, int8 in (((8, 16), True), ((32, 8), False), ((8, 16), True)))
    with pytest.raises(ValueError, match="layer_end"):  # weights of two formats
        native.layer_end(torch.randn(2, 16), torch.randn(2, 8), o_proj, torch.ones(8), 1e-5, gate_up, down)


@needs_compiler
def test_released_idle_threads_leave_later_parallel_work_as_it_was():
    """Releasing the calling thread's idle OpenMP workers (before the server's engine thread starts) frees a team
    the next parallel region starts again: products from this thread and from another are unchanged."""
    weight, x = torch.randn(96, 64), torch.randn(5, 64)
    laid = native.panels(weight)
    expected = native.panel_rows(x, laid, 96)
    assert native.release_idle_threads()
    assert torch.equal(native.panel_rows(x, laid, 96), expected)
    from_another: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: from_another.append(native.panel_rows(x, laid, 96)))
    worker.start()
    worker.join()
    assert torch.equal(from_another[0], expected)
