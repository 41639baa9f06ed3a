"""The attention kernels (native, torch's fused calls, blocked products) against a dense fp64 reference, on every
layout of queries and keys the engine produces (a prompt in order, scattered recomputed rows, decoding, a
continuation, keys out of order, windows)."""

import contextlib

import pytest
import torch

from kvreuse.model.attention import (
    QUERY_BLOCK,
    AttentionCall,
    _visible_keys,
    attend,
    attention_calls,
    attention_mask,
    blocked_attention,
    fused_attention,
)
from kvreuse.model import native
from tests.conftest import routed_as_if_amx_bf16

Q_HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 16, 0.25


def reference(q, q_pos, keys, values, k_pos, window):
    grouped_k = keys.double().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    grouped_v = values.double().repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), grouped_k) * SCALE
    scores = scores.masked_fill(~attention_mask(q_pos, k_pos, window), float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), grouped_v).reshape(len(q_pos), -1)


def _layout(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions, key positions) of one layout; keys cover positions [0, 300)."""
    g = torch.Generator().manual_seed(7)
    keys = torch.arange(300)
    layouts = {
        "prompt": (keys, keys),
        "few-scattered": (torch.randperm(299, generator=g)[:40].sort().values, keys),
        "many-scattered": (torch.randperm(299, generator=g)[:200].sort().values, keys),
        "unsorted-queries": (torch.randperm(300, generator=g)[:90], keys),
        "decode": (torch.tensor([299]), keys),
        "continuation": (torch.arange(230, 300), keys),
        "scattered-then-run": (torch.cat([torch.randperm(200, generator=g)[:30].sort().values, torch.arange(240, 300)]),
                               keys),
        "keys-out-of-order": (torch.arange(100, 300), torch.randperm(300, generator=g)),
    }
    return layouts[name]


LAYOUTS = ["prompt", "few-scattered", "many-scattered", "unsorted-queries", "decode", "continuation",
           "scattered-then-run", "keys-out-of-order"]


def _inputs(q_pos, k_pos, dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(q_pos), Q_HEADS, HEAD_DIM, generator=g) * 2
    keys = torch.randn(len(k_pos), KV_HEADS, HEAD_DIM, generator=g) * 2
    values = torch.randn(len(k_pos), KV_HEADS, HEAD_DIM, generator=g)
    return q.to(dtype), keys.to(dtype), values.to(dtype)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", ["native", "torch", "blocked"])
def test_kernels_equal_dense_attention_in_fp32(kernel, layout, window):
    """native: `attend` as it runs (the native kernels where they are built); torch: `attend` without them."""
    q_pos, k_pos = _layout(layout)
    q, keys, values = _inputs(q_pos, k_pos, torch.float32)
    run = blocked_attention if kernel == "blocked" else attend
    with native.disabled() if kernel == "torch" else contextlib.nullcontext():
        out = run(q, q_pos, keys, values, k_pos, window, SCALE)
    torch.testing.assert_close(out.double(), reference(q, q_pos, keys, values, k_pos, window), atol=2e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_attends_within_bf16_rounding(layout):
    """One bf16 query (decoding) attends in the native decoding kernel where it is built, which sums the same bf16
    inputs in fp32 and rounds once. Several attend in the native prefill kernel where it is built, else in blocked
    products; where the CPU has AMX-BF16, in torch's fused calls."""
    q_pos, k_pos = _layout(layout)
    q, keys, values = _inputs(q_pos, k_pos, torch.bfloat16)
    out = attend(q, q_pos, keys, values, k_pos, 24, SCALE)
    error = (out.double() - reference(q, q_pos, keys, values, k_pos, 24)).abs()
    if len(q_pos) == 1 and native.available():
        fp32 = attend(q.float(), q_pos, keys.float(), values.float(), k_pos, 24, SCALE)
        assert torch.equal(out, fp32.bfloat16())
    elif native.bf16_in_amx():
        assert torch.equal(out, fused_attention(q, q_pos, keys, values, k_pos, 24, SCALE))
    elif native.available():
        # Its scores are exact and at most its weights are rounded before the values: about the output's own
        # rounding (mean 8e-4 here, blocked products 2.5e-3).
        assert error.max() < 0.03 and error.mean() < 1.5e-3, (error.max(), error.mean())
    else:
        assert torch.equal(out, blocked_attention(q, q_pos, keys, values, k_pos, 24, SCALE))
    # Blocked, the scores come out of the bf16 product rounded to bf16 (relative 2^-9; these scores reach about
    # 20), so single outputs move by a few hundredths; a key masked wrongly moves them by tenths.
    assert error.max() < 0.06 and error.mean() < 5e-3, (error.max(), error.mean())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_queries_attend_in_torch_s_fused_kernel_where_the_cpu_has_amx(monkeypatch, layout):
    """Where the CPU multiplies bf16 in AMX tiles, torch's fused kernel outruns the native prefill kernel: more than
    one bf16 query attends in its calls, within bf16's rounding; one query keeps the native decoding kernel."""
    if not native.available():
        pytest.skip("no native kernels: bf16 attends in blocked products")
    routed_as_if_amx_bf16(monkeypatch, True)
    kernel, calls = native.prefill_attention, []
    monkeypatch.setattr(native, "prefill_attention", lambda *args: calls.append(args) or kernel(*args))
    q_pos, k_pos = _layout(layout)
    q, keys, values = _inputs(q_pos, k_pos, torch.bfloat16)
    out = attend(q, q_pos, keys, values, k_pos, 24, SCALE)
    assert not calls
    if len(q_pos) == 1:
        fp32 = attend(q.float(), q_pos, keys.float(), values.float(), k_pos, 24, SCALE)
        assert torch.equal(out, fp32.bfloat16())
    else:
        assert torch.equal(out, fused_attention(q, q_pos, keys, values, k_pos, 24, SCALE))
    error = (out.double() - reference(q, q_pos, keys, values, k_pos, 24)).abs()
    assert error.max() < 0.06 and error.mean() < 5e-3, (error.max(), error.mean())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_queries_over_keys_in_order_attend_in_amx_tiles_where_the_cpu_has_them(monkeypatch, layout):
    """bf16 queries over keys in position order (a prompt, a continuation, scattered rows) with no window attend in
    the AMX kernel; keys out of order and windows take torch's fused calls; one query the decoding kernel."""
    if not (native.available() and native.bf16_in_amx()):
        pytest.skip("no AMX-BF16 on this CPU")
    kernel, calls = native.amx_causal_attention, []
    monkeypatch.setattr(native, "amx_causal_attention", lambda *args: calls.append(args) or kernel(*args))
    q_pos, k_pos = _layout(layout)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(q_pos), Q_HEADS, 64, generator=g).bfloat16()
    keys, values = (torch.randn(len(k_pos), KV_HEADS, 64, generator=g).bfloat16() for _ in range(2))
    for window in (None, 24):
        calls.clear()
        out = attend(q, q_pos, keys, values, k_pos, window, SCALE)
        assert bool(calls) == (layout not in ("decode", "keys-out-of-order") and window is None), window
        error = (out.double() - reference(q, q_pos, keys, values, k_pos, window)).abs()
        assert error.max() < 0.06 and error.mean() < 5e-3, (window, error.max(), error.mean())


def test_blocks_of_a_prompt_score_only_the_keys_up_to_their_last_query():
    """Causality halves the work: each block of a prompt in order scores the keys up to its own last row, and
    masks only its diagonal square. Under a window the keys before every query's window are skipped too, and
    only the keys some of its queries cannot see are masked."""
    n = 5 * QUERY_BLOCK
    positions = torch.arange(n)
    firsts = range(0, n, QUERY_BLOCK)
    spans = _visible_keys(positions, positions, None)
    assert [(b.lo, b.hi, b.mask_lo, b.mask_hi) for b in spans] == [
        (0, first + QUERY_BLOCK, first + 1, first + QUERY_BLOCK) for first in firsts]
    decode = _visible_keys(torch.tensor([n]), torch.arange(n + 1), None)
    assert [(b.first, b.end, b.lo, b.hi, b.mask_hi - b.mask_lo) for b in decode] == [(0, 1, 0, n + 1, 0)]
    window = 2 * QUERY_BLOCK
    windowed = _visible_keys(positions, positions, window)
    assert [(b.lo, b.hi) for b in windowed] == [(max(0, first - window + 1), first + QUERY_BLOCK) for first in firsts]
    assert [(b.mask_lo, b.mask_hi) for b in windowed[3:]] == [(first - window + 1, first + QUERY_BLOCK)
                                                             for first in firsts[3:]]


def test_scattered_queries_attend_in_groups_and_a_trailing_run_in_a_diagonal_call():
    """Rows that end the prompt in one run (a question, a recency window) see every key before them and their own
    rows causally: one diagonal call, which scores neither the masked upper triangle nor a mask. Scattered rows
    before it attend in groups; under a window, or for a run too short to pay for its own call, nothing changes."""
    keys = torch.arange(2000)
    scattered = attention_calls(torch.arange(0, 1990, 25), keys, None)
    assert len(scattered) > 1 and sum(c.scores for c in scattered) < 0.6 * 80 * 2000
    question = attention_calls(torch.arange(1940, 2000), keys, None)
    assert question == [AttentionCall(0, 60, 0, 2000, diagonal=True)]
    assert (question[0].plain_scores, question[0].causal_scores) == (60 * 1940, 60 * 61 // 2)
    sinks_then_run = attention_calls(torch.cat([torch.arange(100, 104), torch.arange(1700, 2000)]), keys, None)
    assert sinks_then_run == [AttentionCall(0, 4, 0, 104, masked=True), AttentionCall(4, 304, 0, 2000, diagonal=True)]
    assert attention_calls(torch.arange(1990, 2000), keys, None) == [AttentionCall(0, 10, 0, 2000, masked=True)]
    assert not any(c.diagonal for c in attention_calls(torch.arange(1940, 2000), keys, 512))
