"""Attention over a request's cache, exact by position: which kernel calls cover the visible keys
(`attention_calls`, priced by the cost model too) and the kernels that run them.

fp32 runs kvreuse.model.native's kernels, which mask by position and never build a mask: one query (a decoding
step) in its decoding kernel (torch's spent about 150 us per layer on one query over 515 keys), more in its
prefill kernel, 1.4-1.8x torch's fused SDPA on a causal prompt and 2.6-2.9x on rows scattered over it. Without
them (no C compiler), fp32 runs torch's fused SDPA kernel as `attention_calls` plans, which also describe the
work of an attention to the cost model.
One bf16 query runs the native decoding kernel too, which reads bf16 keys and values and sums in fp32. More bf16
queries run the native prefill kernel too: with AVX512-BF16 both its products run in the bf16 dot-product
instruction (15 ms for SmolLM2's 2048 causal rows, against 26 ms for the fp32 kernel and for `blocked_attention`),
elsewhere on the bf16 widened to fp32 (26 ms, where `blocked_attention` took 80 ms with oneDNN limited to AVX-512
without BF16 and 4.3 s limited to AVX2). Without a C compiler bf16 runs `blocked_attention`, two batched matrix
products per block of queries: torch's fused kernel computes bf16 at fp32's speed.
Where the CPU has AMX-BF16 it does not: it multiplies bf16 in AMX tiles, and there more than one bf16 query runs it
(`fused_attention`). SmolLM2's heads on a 2-core Xeon with AMX, time of the native kernel over the fused calls':
2.5x on 1024 causal rows, 2.9x on 1600, 3.4x on 4096; on the rows a reuse method recomputes (2%, 15% or 35% of 1024,
1600 or 4096 keys, the last 32 too) 0.96x (15% of 1024) to 1.9x, 1.28x at the median. Queries over keys in
position order (a prompt, a continuation, a plan's recomputed rows; heads of 64, no window shorter than the keys)
run native's `amx_causal_attention` there instead, 1.5-1.9x the fused kernel's speed on 512-4096 causal rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvreuse.model import native

# Query groups for attention of scattered rows: enough groups to skip most masked-out keys, each big enough
# for the attention kernel to run efficiently.
MAX_QUERY_GROUPS = 8
MIN_QUERIES_PER_GROUP = 16
# Grouping must cut the scores computed by at least this much, or one masked call runs instead.
GROUPS_MUST_SAVE = 0.8
# Queries that end the prompt in one run of rows (a question, a recency window, a continuation) attend in a call of
# their own from this many rows on: see AttentionCall.diagonal.
MIN_DIAGONAL_ROWS = 16


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean [..., n_q, n_k]: a query at position p sees keys at positions <= p (and > p - window, if any).
    Leading dimensions are a batch of sequences, each with its own positions."""
    keys, queries = k_pos.unsqueeze(-2), q_pos.unsqueeze(-1)
    allowed = keys <= queries
    if window is not None:
        allowed &= keys > queries - window
    return allowed


def _is_plain_causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    # Same rows on both sides in increasing order: the mask is the lower triangle, which SDPA builds itself.
    return q_pos.shape == k_pos.shape and bool(torch.equal(q_pos, k_pos)) and bool((q_pos.diff() > 0).all())


def _keys_are_positions(k_pos: torch.Tensor) -> bool:
    """Key row i holds position i (a prompt laid out in order), so a query's position is also its row."""
    n = k_pos.numel()
    return int(k_pos[0]) == 0 and int(k_pos[-1]) == n - 1 and bool((k_pos.diff() == 1).all())


@dataclass(frozen=True)
class AttentionCall:
    """One attention kernel call: queries [first, end) over key rows [lo, hi)."""

    first: int
    end: int
    lo: int
    hi: int
    causal: bool = False  # the kernel's own lower triangle: queries are the key rows (or padded to them)
    padded: bool = False  # the queries are scattered into a block as long as the keys, at their rows
    masked: bool = False  # an explicit mask by position
    # The queries are the last key rows, in order: they see every key before them and the run causally. Two
    # kernel calls, unmasked over the keys before the run and causal over the run, merged by their log-sum-exp:
    # a mask would cost the kernel its fast path and score the upper triangle too.
    diagonal: bool = False

    @property
    def causal_scores(self) -> int:
        """Scores computed by a causal kernel (which skips the upper triangle of its square)."""
        keys = self.hi - self.lo
        if self.causal:
            rows = keys if self.padded else self.end - self.first
            return rows * (keys + 1) // 2
        rows = self.end - self.first
        return rows * (rows + 1) // 2 if self.diagonal else 0

    @property
    def plain_scores(self) -> int:
        """Scores computed by a kernel without a causal mask of its own (masked or not)."""
        rows, keys = self.end - self.first, self.hi - self.lo
        if self.causal:
            return 0
        return rows * (keys - rows) if self.diagonal else rows * keys

    @property
    def scores(self) -> int:
        """Query-key scores the kernel computes."""
        return self.causal_scores + self.plain_scores


def attention_calls(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> list[AttentionCall]:
    """How `attend` runs queries at `q_pos` over keys at `k_pos` in torch's fused kernel (fp32 without the native
    kernels): the cheapest exact kernel calls. The cost model describes an attention's work by the same calls
    (kvreuse.controller.cost), with seconds per score fitted to `attend` as it runs, native kernel or not."""
    n, m = q_pos.numel(), k_pos.numel()
    if window is None and _is_plain_causal(q_pos, k_pos):
        return [AttentionCall(0, n, 0, m, causal=True)]
    if window is None and bool(k_pos.max() <= q_pos.min()):  # every key visible to every query, e.g. decoding
        return [AttentionCall(0, n, 0, m)]
    if _keys_are_positions(k_pos) and bool((q_pos.diff() > 0).all()):
        run = _final_run(q_pos) if window is None else 0
        if run >= MIN_DIAGONAL_ROWS:
            head = n - run
            before = _query_groups(q_pos[:head], None) if head else []
            return before + [AttentionCall(head, n, 0, int(q_pos[-1]) + 1, diagonal=True)]
        if window is None and 2 * n > m:
            # Many queries over a prompt in order: SDPA's causal kernel skips the masked blocks, which a general
            # mask cannot, so the queries are placed at their rows and taken back out afterwards.
            return [AttentionCall(0, n, 0, m, causal=True, padded=True)]
        return _query_groups(q_pos, window)
    return [AttentionCall(0, n, 0, m, masked=True)]


def _final_run(q_pos: torch.Tensor) -> int:
    """How many of the sorted queries end them in consecutive positions."""
    gaps = (q_pos.diff() != 1).nonzero()
    return q_pos.numel() - (int(gaps[-1]) + 1 if gaps.numel() else 0)


def _query_groups(q_pos: torch.Tensor, window: int | None) -> list[AttentionCall]:
    """Few sorted queries scattered over a prompt in order: a masked kernel would score every query against
    every key, twice the work causality needs on average. Groups of neighbouring queries attend only the key
    rows they can see (rows are positions here), which cuts most of that waste."""
    groups = max(1, min(MAX_QUERY_GROUPS, q_pos.numel() // MIN_QUERIES_PER_GROUP))
    bounds = torch.linspace(0, q_pos.numel(), groups + 1).long().tolist()
    calls = []
    for first, end in zip(bounds, bounds[1:]):
        lo = 0 if window is None else max(0, int(q_pos[first]) - window + 1)
        calls.append(AttentionCall(first, end, lo, int(q_pos[end - 1]) + 1, masked=True))
    one = AttentionCall(0, q_pos.numel(), calls[0].lo, calls[-1].hi, masked=True)
    # Queries bunched at the end (a question after its context) see nearly every key from every group: there the
    # split only adds calls (60 such queries over 2069 keys, fp32: 2.33 ms in 3 groups, 1.88 ms in one call).
    return calls if sum(c.scores for c in calls) < GROUPS_MUST_SAVE * one.scores else [one]


# Dtypes attended by `blocked_attention` instead of the fused kernel, where the native one is not built (see the
# module's docstring).
BLOCKED_DTYPES = (torch.bfloat16,)
# Queries per block: their scores over every visible key ([kv heads, 64 x query groups, keys]) stay small
# enough to be cached between the two products; 32-256 measured 1.1-1.4x slower than 64 at 1-4K tokens.
QUERY_BLOCK = 64


def attend(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k_pos: torch.Tensor,
           window: int | None, scale: float) -> torch.Tensor:
    """Rotated queries [n, Hq, D] over rotated keys/values [m, Hkv, D], exact causal mask by position whatever
    the row order (and the sliding window, if any); returns [n, Hq * D]."""
    if q.shape[0] == 1 and native.decode_attention_runs(q, keys):
        return _one_query(q, q_pos, keys, values, k_pos, window, scale)
    in_amx = q.dtype == torch.bfloat16 and native.bf16_in_amx()
    if (in_amx and (window is None or window >= keys.shape[0]) and native.amx_causal_attention_runs(q, keys, values)
            and _keys_are_positions(k_pos)):
        return native.amx_causal_attention(q, q_pos, keys, values, scale)
    if native.prefill_attention_runs(q, keys, values) and not in_amx:
        return native.prefill_attention(q, q_pos, keys, values, k_pos, window, scale)
    if q.dtype in BLOCKED_DTYPES and not in_amx:
        return blocked_attention(q, q_pos, keys, values, k_pos, window, scale)
    return fused_attention(q, q_pos, keys, values, k_pos, window, scale)


def fused_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    k_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """`attend` as the calls of `attention_calls`, each in torch's fused kernel."""
    outputs = [_run_fused(call, q, q_pos, keys, values, k_pos, window, scale)
               for call in attention_calls(q_pos, k_pos, window)]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _one_query(q, q_pos, keys, values, k_pos, window, scale) -> torch.Tensor:
    """A single query over keys [m, Hkv, D] (a request's cache layout, read in place) in the native kernel,
    masked by the keys' positions."""
    rows, heads = keys.shape[:2]
    grouped = q.view(1, heads, -1, q.shape[-1])
    out = native.decode_attention(grouped, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], k_pos[None],
                                  torch.full((1,), rows), q_pos, window, scale)
    return out.view(1, -1)


def one_each_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, lengths: torch.Tensor, window: int | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of `attend_one_each`, [B, 1, 1, L]: 0 where sequence b's query at q_pos[b] sees its key
    row (by position, within its first lengths[b] rows), -inf elsewhere. It depends on the step, not the layer,
    so a decoding step builds it once per window."""
    visible = attention_mask(q_pos[:, None], k_pos, window)  # [B, 1, L]
    visible &= (torch.arange(k_pos.shape[-1], device=k_pos.device) < lengths[:, None])[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=k_pos.device).masked_fill_(~visible, float("-inf"))[:, None]


def attend_one_each(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One query per sequence of a batch (decoding): q [B, Hq, D] over each sequence's keys and values
    [B, Hkv, L, D], where `one_each_mask` allows; returns [B, Hq * D]. The query heads that share a KV head are
    rows of one product, so each key is read once, not once per query head."""
    batch, q_heads, head_dim = q.shape
    grouped = q.view(batch, keys.shape[1], q_heads // keys.shape[1], head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, q_heads * head_dim)


def _run_fused(call: AttentionCall, q, q_pos, keys, values, k_pos, window, scale) -> torch.Tensor:
    if call.diagonal and q.device.type == "cpu":
        return _diagonal(q[call.first : call.end], keys[call.lo : call.hi], values[call.lo : call.hi], scale)
    if call.padded:
        padded = q.new_zeros((keys.shape[0], *q.shape[1:]))
        padded[q_pos] = q
        return _sdpa(padded, keys, values, None, True, scale)[q_pos]
    queries = slice(call.first, call.end)
    # a diagonal call on a device without the CPU kernel's log-sum-exp runs masked
    masked = call.masked or call.diagonal
    mask = attention_mask(q_pos[queries], k_pos[call.lo : call.hi], window) if masked else None
    return _sdpa(q[queries], keys[call.lo : call.hi], values[call.lo : call.hi], mask, call.causal, scale)


def _diagonal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries [n, Hq, D] that are the last n of the keys [m, Hkv, D]: attention over the keys before them, and
    causal attention over their own rows, as two calls of the CPU flash kernel whose outputs are merged by weight
    (each part's share of the softmax's denominator, from its log-sum-exp)."""
    n, split = q.shape[0], keys.shape[0] - q.shape[0]
    if split == 0:
        return _sdpa(q, keys, values, None, True, scale)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads = q.transpose(0, 1)[None]
    before, before_lse = flash(heads, keys[:split].transpose(0, 1)[None], values[:split].transpose(0, 1)[None],
                               scale=scale)[:2]
    own, own_lse = flash(heads, keys[split:].transpose(0, 1)[None], values[split:].transpose(0, 1)[None],
                         is_causal=True, scale=scale)[:2]
    weight = torch.sigmoid(before_lse - own_lse)[..., None].to(own.dtype)  # share of the keys before the run
    out = torch.lerp(own, before, weight)
    return out[0].transpose(0, 1).reshape(n, -1)


def _sdpa(q, keys, values, mask, causal, scale) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def blocked_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      k_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """`attend` as scores = q k^T, softmax, scores v for each block of QUERY_BLOCK queries, over only the keys
    the block can see when the keys are in position order. The query heads that share a KV head are stacked
    as rows of one product, so keys are never repeated per head. Any dtype; in bf16 the scores come out of the
    product rounded to bf16 and the softmax accumulates in fp32."""
    n, q_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    queries = (q * scale).view(n, kv_heads, group, head_dim).transpose(0, 1).contiguous()
    # Head-major copies, once per call: the products would otherwise copy the keys again for every block.
    keys_t, values_h = keys.permute(1, 2, 0).contiguous(), values.transpose(0, 1).contiguous()
    out = q.new_empty((n, kv_heads, group, head_dim))
    for block in _visible_keys(q_pos, k_pos, window):
        first, end, lo, hi = block.first, block.end, block.lo, block.hi
        rows = end - first
        scores = torch.bmm(queries[:, first:end].reshape(kv_heads, rows * group, head_dim), keys_t[:, :, lo:hi])
        scores = scores.view(kv_heads, rows, group, hi - lo)
        if block.mask_hi > block.mask_lo:
            hidden = ~attention_mask(q_pos[first:end], k_pos[block.mask_lo : block.mask_hi], window)
            scores[..., block.mask_lo - lo : block.mask_hi - lo].masked_fill_(hidden[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, -1).view(kv_heads, rows * group, hi - lo)
        out[first:end] = torch.bmm(probs, values_h[:, lo:hi]).view(kv_heads, rows, group, head_dim).transpose(0, 1)
    return out.view(n, q_heads * head_dim)


@dataclass(frozen=True)
class QueryBlock:
    """Queries [first, end) see no key outside rows [lo, hi); of those, only rows [mask_lo, mask_hi) can be
    hidden from some of its queries (later than its first query, or before its last one's window)."""

    first: int
    end: int
    lo: int
    hi: int
    mask_lo: int
    mask_hi: int


def _visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> list[QueryBlock]:
    """The blocks of QUERY_BLOCK queries and the key rows each one must score. Keys out of position order
    (never written so by the engine, but allowed) are all scored, all masked."""
    n, m = q_pos.numel(), k_pos.numel()
    firsts = list(range(0, n, QUERY_BLOCK))
    if n == 0:
        return []
    if n <= QUERY_BLOCK and window is None and m and int(k_pos.max()) <= int(q_pos.min()):
        return [QueryBlock(0, n, 0, m, 0, 0)]  # every key visible to every query: decoding
    if m == 0 or not bool((k_pos.diff() >= 0).all()):
        return [QueryBlock(first, min(n, first + QUERY_BLOCK), 0, m, 0, m) for first in firsts]
    pad = len(firsts) * QUERY_BLOCK - n
    blocks = F.pad(q_pos, (0, pad), value=int(q_pos[-1])).view(-1, QUERY_BLOCK)
    lowest, highest = blocks.amin(1), blocks.amax(1)
    # Together the block's queries see positions (lowest - window, highest]; all of them see
    # (highest - window, lowest].
    hi = torch.searchsorted(k_pos, highest, right=True)
    late = torch.searchsorted(k_pos, lowest, right=True).clamp(max=hi)  # keys after the first query start here
    if window is None:
        lo = early_end = torch.zeros_like(hi)
    else:
        lo = torch.searchsorted(k_pos, lowest - window + 1)
        early_end = torch.searchsorted(k_pos, highest - window + 1).clamp(max=hi)  # keys before the last's window
    spans = zip(firsts, lo.tolist(), hi.tolist(), late.tolist(), early_end.tolist())
    return [_block(first, min(n, first + QUERY_BLOCK), *span) for first, *span in spans]


def _block(first: int, end: int, lo: int, hi: int, late: int, early_end: int) -> QueryBlock:
    """The masked rows are [late, hi) (keys later than the first query) and [lo, early_end) (keys before the last
    query's window): one range covering both, empty when neither holds a row."""
    late_rows, early_rows = hi > late, early_end > lo
    if late_rows and early_rows:
        return QueryBlock(first, end, lo, hi, lo, hi)
    if late_rows:
        return QueryBlock(first, end, lo, hi, late, hi)
    if early_rows:
        return QueryBlock(first, end, lo, hi, lo, early_end)
    return QueryBlock(first, end, lo, hi, 0, 0)
