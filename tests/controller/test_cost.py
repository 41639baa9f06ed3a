"""The cost model on synthetic profiles: the pipeline it replays, the rows each layer computes."""

from __future__ import annotations

import pytest

from kvreuse.controller.cost import layer_work, predict
from kvreuse.controller.profile import TierProfile
from kvreuse.fusion.methods import parse_method
from kvreuse.fusion.plan import Block, PlacedSegment, PrefixSplit
from kvreuse.fusion.segments import Request, Segment, SegmentKind

from .support import KV_BYTES, LAYERS, rag_plan, synthetic_profile

CHUNK_ROWS = 5 * 200  # rag_plan: 5 chunks of 200 tokens, after a 4-token prefix, before 20 fresh tokens


def tier(seconds_per_layer_of_chunks: float) -> dict[str, TierProfile]:
    """A tier reading all chunk rows of one layer in the given time, with no latency."""
    return {"slow": TierProfile("slow", CHUNK_ROWS * KV_BYTES / seconds_per_layer_of_chunks, 0.0)}


@pytest.mark.parametrize("read, compute", [(0.010, 0.001), (0.001, 0.010)])
def test_naive_pipeline_is_bounded_by_the_slower_side_per_layer(read, compute):
    """Layer i+1 loads while layer i computes: L x max(read, compute) + the first read or the last compute."""
    computed_rows = 4 + 20  # the prefix (a miss here) and the fresh tokens
    profile = synthetic_profile(compute / computed_rows, tiers=tier(read))
    plan, tiers = rag_plan("naive", "slow")
    predicted = predict(plan, tiers, profile)
    assert predicted.seconds == pytest.approx(LAYERS * max(read, compute) + min(read, compute))
    assert predicted.load_seconds == pytest.approx(LAYERS * read)
    assert predicted.compute_seconds == pytest.approx(LAYERS * compute)


@pytest.mark.parametrize("read, compute", [(0.010, 0.001), (0.001, 0.010)])
def test_reads_that_do_not_wait_run_before_each_layer_not_beside_it(read, compute):
    """A CPU-bound tier is read inline: every layer pays its read and its compute one after the other."""
    computed_rows = 4 + 20
    cpu_bound = {"slow": TierProfile("slow", CHUNK_ROWS * KV_BYTES / read, 0.0, reads_wait=False)}
    profile = synthetic_profile(compute / computed_rows, tiers=cpu_bound)
    plan, tiers = rag_plan("naive", "slow")
    assert predict(plan, tiers, profile).seconds == pytest.approx(LAYERS * (read + compute))


def test_nothing_loaded_costs_only_compute():
    profile = synthetic_profile(1e-4, tiers=tier(1.0))
    plan, tiers = rag_plan("full", "slow")
    assert predict(plan, tiers, profile).seconds == pytest.approx(LAYERS * 1e-4 * (4 + CHUNK_ROWS + 20))


def test_cacheblend_layers_narrow_as_its_schedule_says():
    plan, _ = rag_plan("cacheblend:0.2", "slow")
    work = layer_work(plan, LAYERS)
    exact = 4 + 20  # prefix and fresh rows are never dropped
    assert [w.rows.numel() for w in work[:4]] == [exact + CHUNK_ROWS, exact + 300, exact + 200, exact + 200]
    assert work[1].qkv_rows == exact + CHUNK_ROWS  # layer 1 projects every row before it narrows
    assert work[2].qkv_rows == exact + 300
    assert all(w.rows.numel() == exact + 200 for w in work[2:])


def test_attention_is_priced_per_score_of_the_runtime_calls():
    profile = synthetic_profile(0.0, score_seconds=1e-9)
    plan, tiers = rag_plan("full", "memory")
    rows = 4 + CHUNK_ROWS + 20
    causal_scores = rows * (rows + 1) // 2  # one causal kernel call over the whole prompt
    assert predict(plan, tiers, profile).seconds == pytest.approx(LAYERS * causal_scores * 1e-9)


def test_causal_calls_have_a_price_per_score_of_their_own():
    from dataclasses import replace

    profile = synthetic_profile(0.0, score_seconds=1e-9)
    profile = replace(profile, compute=replace(profile.compute, causal_score_seconds=4e-10))
    plan, tiers = rag_plan("full", "memory")
    rows = 4 + CHUNK_ROWS + 20
    assert predict(plan, tiers, profile).seconds == pytest.approx(LAYERS * rows * (rows + 1) // 2 * 4e-10)


def test_the_attention_fit_tells_causal_from_masked_scores():
    from kvreuse.controller.measure import _fit_attention
    from kvreuse.model.attention import AttentionCall

    def seconds(calls):  # 3 ns per masked score, 1 ns per causal one, 50 ns per key, 20 us per call
        return sum((1e-9 if c.causal else 3e-9) * c.scores + 50e-9 * (c.hi - c.lo) + 20e-6 for c in calls)

    layouts = [[AttentionCall(0, n, 0, n, causal=True)] for n in (512, 1024, 2048)]
    layouts += [[AttentionCall(0, q, 0, n, masked=True)] * groups for q, n, groups in
                [(16, 1024, 1), (64, 2048, 4), (32, 512, 2), (128, 1024, 8)]]
    masked, causal, key, call = _fit_attention([(calls, seconds(calls)) for calls in layouts])
    assert (masked, causal, key, call) == pytest.approx((3e-9, 1e-9, 50e-9, 20e-6), rel=1e-3)


def test_an_unprofiled_tier_is_named():
    plan, tiers = rag_plan("naive", "nvme")
    with pytest.raises(ValueError, match="'nvme'"):
        predict(plan, tiers, synthetic_profile(1e-4))


def test_cachetune_reads_only_the_rows_it_does_not_recompute():
    profile = synthetic_profile(0.0, tiers=tier(0.010))
    plan, tiers = rag_plan("cachetune:0.25", "slow")
    assert predict(plan, tiers, profile).load_seconds == pytest.approx(LAYERS * 0.010 * 0.75)
    assert parse_method("cachetune:0.25").needs_ranking


def test_a_prefix_restored_layer_wise_is_priced_as_it_runs():
    """A stored prefix split layer-wise computes every prefix row on the layers below the split and reads its
    blocks only from there on; token-wise, it computes its first rows on every layer."""
    request = Request([Segment(SegmentKind.PREFIX, [1] * 512), Segment(SegmentKind.FRESH, [3] * 20)])
    blocks = [Block(i, f"block-{i}", slice(256 * i, 256 * (i + 1)), 0, 256) for i in range(2)]
    profile = synthetic_profile(1e-5, tiers={"slow": TierProfile("slow", 512 * KV_BYTES / 0.002, 0.0)})
    for split, computed, read_layers in [(PrefixSplit("layerwise", blocks, computed_layers=10), None, LAYERS - 10),
                                         (PrefixSplit("cake", blocks, computed_rows=100), 100 + 20, LAYERS)]:
        placed = [PlacedSegment(request.segments[0], split=split), PlacedSegment(request.segments[1])]
        plan = parse_method("prefix").plan(request, placed)
        work = [w.rows.numel() for w in layer_work(plan, LAYERS)]
        assert work == ([532] * 10 + [20] * (LAYERS - 10) if computed is None else [computed] * LAYERS)
        prediction = predict(plan, ["slow"] * len(plan.reused), profile)
        loaded_share = 1.0 if computed is None else (512 - 100) / 512
        assert prediction.load_seconds == pytest.approx(read_layers * 0.002 * loaded_share)
