"""Which rows each method recomputes, on inputs where the right rows are known: LegoLink the first k tokens of
every chunk that moved, CacheTune the rows its stored ranking puts highest (and the ranking scores a token's
low-frequency energy), CacheBlend the rows whose stored KV deviates most at its check layers."""

from __future__ import annotations

import pytest
import torch

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.eval.datasets import load_dataset
from kvreuse.eval.metrics import first_token_kl
from kvreuse.fusion.compile import compile_chunk, frequency_ranking
from kvreuse.fusion.executor import most_deviating, question_attention
from kvreuse.fusion.methods import CUE_TOKENS, answers_like_examples, parse_method, shares_of
from kvreuse.fusion.plan import FusionPlan, Narrowing, PlacedSegment
from kvreuse.fusion.segments import Request, Segment, SegmentKind
from kvreuse.model.kv_cache import KVCache
from kvreuse.store.spec import open_store

from ..conftest import random_ids
from ..eval.support import DATASETS


def rag(chunks: tuple[int, ...] = (20, 16, 12), prefix: int = 5, fresh: int = 4) -> Request:
    return Request([Segment(SegmentKind.PREFIX, random_ids(prefix, 0)),
                    *(Segment(SegmentKind.CHUNK, random_ids(n, i + 1)) for i, n in enumerate(chunks)),
                    Segment(SegmentKind.FRESH, random_ids(fresh, 99))])


def all_hits(request: Request, rankings: dict[int, torch.Tensor] | None = None) -> list[PlacedSegment]:
    """Every chunk stored (a hit, with its ranking if given); the prefix and fresh tokens computed."""
    rankings = rankings or {}
    return [PlacedSegment(s, key=f"k{i}", hit=True, ranking=rankings.get(i)) if s.kind == SegmentKind.CHUNK
            else PlacedSegment(s) for i, s in enumerate(request.segments)]


def computed_chunk_rows(request: Request, plan) -> dict[int, list[int]]:
    """For each chunk segment, the rows (indices into the chunk) the plan computes from layer 0 on."""
    computed = set(plan.compute_rows.tolist())
    return {i: [r for r in range(len(s.token_ids)) if s.start + r in computed]
            for i, s in enumerate(request.segments) if s.kind == SegmentKind.CHUNK}


def test_legolink_recomputes_the_first_k_tokens_of_every_moved_chunk():
    request = rag()
    plan = parse_method("legolink:3").plan(request, all_hits(request))
    assert computed_chunk_rows(request, plan) == {1: [0, 1, 2], 2: [0, 1, 2], 3: [0, 1, 2]}
    loaded = {span.key: span.load.tolist() for span in plan.reused}
    assert loaded["k1"] == list(range(3, 20))  # the recomputed sink is never transferred


def test_legolink_leaves_a_chunk_that_starts_the_prompt_as_stored():
    request = Request([Segment(SegmentKind.CHUNK, random_ids(10, 1)), Segment(SegmentKind.CHUNK, random_ids(8, 2)),
                       Segment(SegmentKind.FRESH, random_ids(3, 99))])
    plan = parse_method("legolink:2").plan(request, all_hits(request))
    assert computed_chunk_rows(request, plan) == {0: [], 1: [0, 1]}


def test_a_recency_window_recomputes_the_chunk_rows_nearest_the_question():
    request = rag()  # chunk rows 5-24, 25-40, 41-52, then the question
    plan = parse_method("legolink:0:recent=20").plan(request, all_hits(request))
    assert computed_chunk_rows(request, plan) == {1: [], 2: list(range(8, 16)), 3: list(range(12))}
    plan = parse_method("legolink:3:recent=20").plan(request, all_hits(request))
    assert computed_chunk_rows(request, plan) == {1: [0, 1, 2], 2: [0, 1, 2, *range(8, 16)], 3: list(range(12))}


def test_the_recency_window_counts_from_the_last_chunk_even_when_it_missed():
    request = rag()
    placed = all_hits(request)
    placed[3] = PlacedSegment(request.segments[3])  # the last chunk is computed anyway
    plan = parse_method("legolink:0:recent=20").plan(request, placed)
    assert computed_chunk_rows(request, plan)[2] == list(range(8, 16))


@pytest.mark.parametrize("spec, message", [("legolink:4:recent=x", "whole number"),
                                           ("legolink:4:sinks=2", "unknown option 'sinks=2'"),
                                           ("guarded:1e-3:recent", "unknown option 'recent'"),
                                           ("guarded:1e-3:examples=-1", "whole number"),
                                           ("guarded:1e-3:sinks=2:sinks=9", "option sinks given twice")])
def test_bad_window_options_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_cachetune_recomputes_the_highest_ranked_rows_of_each_chunk():
    request = rag(chunks=(20, 10))
    rankings = {1: torch.linspace(0, 1, 20).roll(7), 2: torch.tensor([.9, .1, .2, .8, .3, .4, .95, .5, .6, .0])}
    plan = parse_method("cachetune:0.3").plan(request, all_hits(request, rankings))
    top_of_first = sorted(rankings[1].topk(6).indices.tolist())
    assert computed_chunk_rows(request, plan) == {1: top_of_first, 2: [0, 3, 6]}
    loaded = {span.key: span.load.tolist() for span in plan.reused}
    assert loaded["k2"] == [1, 2, 4, 5, 7, 8, 9]  # sparse transfer: the recomputed rows are not read


def test_cachetune_recomputes_its_ratio_of_all_chunk_rows_however_short_the_chunks():
    """r is a share of every reused row: 20 chunks of 3 rows at 0.15 recompute 9 rows (each chunk's own share,
    0.45 of a row, would round to none), one per chunk, in the chunks with the largest remainders."""
    request = rag(chunks=(3,) * 20)
    rankings = {i: torch.tensor([0.1, 0.9, 0.5]) for i in range(1, 21)}
    rows = computed_chunk_rows(request, parse_method("cachetune:0.15").plan(request, all_hits(request, rankings)))
    assert sum(map(len, rows.values())) == 9 and all(r in ([], [1]) for r in rows.values())
    assert shares_of([20, 10, 3], 0.3) == [6, 3, 1]  # quotas 6, 3, 0.9
    assert shares_of([5, 5], 0.5) == [3, 2]  # 2.5 each: the total rounds half up, the first chunk takes it


def smooth_bump_on(rows: slice, tokens: int = 64, layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [layers, tokens, heads, dim] whose low-frequency energy sits on `rows` (a slowly varying bump
    there), while every other token carries a larger but fast-alternating signal that a low-pass filter removes."""
    generator = torch.Generator().manual_seed(0)
    t = torch.arange(tokens, dtype=torch.float32)
    alternating = torch.where(t % 2 == 0, 1.0, -1.0) * 4.0
    centre, width = (rows.start + rows.stop - 1) / 2, (rows.stop - rows.start) / 2
    bump = 3.0 * torch.exp(-((t - centre) / width) ** 2)
    signal = torch.where((t >= rows.start) & (t < rows.stop), bump, alternating)
    direction = torch.randn(layers, 1, 2, 8, generator=generator)
    kv = signal[None, :, None, None] * direction
    return kv, kv * 0.5


@pytest.mark.parametrize("rows", [slice(10, 18), slice(40, 50)])
def test_the_frequency_ranking_puts_low_frequency_tokens_first(rows):
    keys, values = smooth_bump_on(rows)
    ranking = frequency_ranking(keys, values)
    top = set(ranking.topk(rows.stop - rows.start).indices.tolist())
    assert len(top & set(range(rows.start, rows.stop))) >= (rows.stop - rows.start) - 2


def test_a_compiled_chunk_stores_the_frequency_ranking_of_its_own_kv(tiny_model):
    ids = random_ids(40, 5)
    entry = compile_chunk(tiny_model, ids, "key", "tiny-model")
    torch.testing.assert_close(entry.meta.ranking, frequency_ranking(entry.k, entry.v).to(entry.k.dtype))


def perturb_stored(engine, request: Request, rows_by_layer: dict[int, list[int]], amount: float = 50.0) -> None:
    """Push the stored KV of the first chunk far off (by `amount`) on the given rows of the given layers."""
    chunk = request.segments[1]
    key = engine.key_of(request, chunk, parse_method("cacheblend"))
    entry = engine.store.get(key)
    for layer, rows in rows_by_layer.items():
        entry.k[layer, rows] += amount
        entry.v[layer, rows] -= amount
    engine.store.delete(key)
    engine.store.put(entry)


def rows_computed_per_layer(engine, request: Request, method: str) -> list[set[int]]:
    policy = parse_method(method)
    plan = policy.plan(request, engine.lookup(request, policy))
    seen: list[set[int]] = []
    engine.executor.run(plan, request.token_ids, observer=lambda layer, q, rows, cache: seen.append(set(rows.tolist())))
    return seen


def test_cacheblend_keeps_recomputing_the_rows_whose_stored_kv_deviates_most(tiny_engine):
    """40 reused rows at ratio 0.1: 6 kept after check layer 1 (1.5 x r), 4 after layer 2. The rows whose stored
    KV was pushed far off at those layers are exactly the ones kept."""
    request = rag(chunks=(20, 20))
    tiny_engine.compile(request, ["cacheblend"])
    deviating_at_1, deviating_at_2 = [2, 5, 9, 11, 16, 19], [5, 11, 16, 19]
    perturb_stored(tiny_engine, request, {1: deviating_at_1, 2: deviating_at_2})
    computed = rows_computed_per_layer(tiny_engine, request, "cacheblend:0.1")
    chunks = range(request.segments[1].start, request.segments[2].start + 20)
    chunk_rows = [sorted(r - chunks.start for r in rows if r in chunks) for rows in computed]
    assert chunk_rows[0] == list(range(40))  # layer 0 runs every reused row
    assert chunk_rows[1] == deviating_at_1
    assert chunk_rows[2] == deviating_at_2


DATASET = DATASETS / "2wikimqa.jsonl"


@pytest.mark.real_model
def test_on_the_real_model_cacheblend_and_legolink_come_closer_to_full_than_naive(embedded_model):
    """First-token KL against full prefill, averaged over four fixed 2wikimqa questions (first 5 passages each):
    recomputing the chosen rows must bring both methods well below naive reuse (measured: naive 0.25,
    cacheblend:0.15 0.13, legolink:16 0.11)."""
    engine = ReuseEngine(embedded_model, open_store("memory:1GB"))
    try:
        kl: dict[str, list[float]] = {"naive": [], "cacheblend:0.15": [], "legolink:16": []}
        for prompt in load_dataset(DATASET, limit=4).prompts:
            request = engine.build_request(prompt.chunks[:5], prompt.question)
            engine.compile(request, list(kl))
            full = engine.prefill(request, "full").logits
            for method, values in kl.items():
                values.append(first_token_kl(full, engine.prefill(request, method).logits))
    finally:
        engine.close()
    mean = {method: sum(values) / len(values) for method, values in kl.items()}
    assert mean["cacheblend:0.15"] < 0.75 * mean["naive"], mean
    assert mean["legolink:16"] < 0.75 * mean["naive"], mean


@pytest.mark.real_model
def test_on_the_real_model_a_recency_window_fixes_what_sinks_alone_leave_on_few_shot_samsum(embedded_model):
    """SAMSum's answer copies the format of the examples nearest it: recomputing the chunk rows among the last 192
    besides the sinks must come far closer to full prefill than the sinks alone (measured on these two prompts:
    legolink:16 0.25 and 0.62, legolink:16:recent=192 0.10 and 0.11)."""
    engine = ReuseEngine(embedded_model, open_store("memory:1GB"))
    try:
        kl: dict[str, list[float]] = {"legolink:16": [], "legolink:16:recent=192": []}
        for prompt in load_dataset(DATASETS / "samsum.jsonl", limit=2).prompts:
            request = engine.build_request(prompt.chunks, prompt.question)
            engine.compile(request, list(kl))
            full = engine.prefill(request, "full").logits
            for method, values in kl.items():
                values.append(first_token_kl(full, engine.prefill(request, method).logits))
    finally:
        engine.close()
    mean = {method: sum(values) / len(values) for method, values in kl.items()}
    assert mean["legolink:16:recent=192"] < 0.5 * mean["legolink:16"], mean


def guarded_plan(engine, request: Request, max_residual: float, method: str = "guarded"):
    """guarded's plan: one check at layer 1 that keeps rows until the deviation left is `max_residual`."""
    policy = parse_method(f"{method}:{max_residual}")
    return policy.plan(request, engine.lookup(request, policy))


def test_a_residual_guard_keeps_the_rows_that_carry_the_deviation(tiny_engine):
    request = rag(chunks=(20, 20))
    tiny_engine.compile(request, ["naive"])
    deviating = [3, 8, 14]
    perturb_stored(tiny_engine, request, {1: deviating}, amount=1000.0)  # far beyond the rows' own deviation
    blend = parse_method("cacheblend:0")  # the same check at layer 1, keeping nothing
    unguarded = tiny_engine.executor.run(blend.plan(request, tiny_engine.lookup(request, blend)), request.token_ids)
    check = unguarded.stats.deviation_checks[0]
    assert check.kept == 0 and check.residual == check.mass > 0
    assert (unguarded.stats.deviation_mass, unguarded.stats.deviation_residual) == (check.mass, check.mass)
    seen: list[set[int]] = []
    guarded = tiny_engine.executor.run(guarded_plan(tiny_engine, request, check.mass / 100), request.token_ids,
                                       observer=lambda layer, q, rows, cache: seen.append(set(rows.tolist())))
    first = request.segments[1].start
    assert sorted(r - first for r in seen[1] if first <= r < first + 40) == deviating
    assert guarded.stats.deviation_checks[0].residual <= check.mass / 100


def test_a_residual_guard_of_zero_recomputes_every_row_and_equals_full_prefill(tiny_engine):
    request = rag(chunks=(20, 20))
    tiny_engine.compile(request, ["naive"])
    guarded = tiny_engine.executor.run(guarded_plan(tiny_engine, request, 0.0), request.token_ids)
    assert guarded.stats.deviation_checks[0].kept == 40
    torch.testing.assert_close(guarded.logits, tiny_engine.prefill(request, "full").logits, atol=1e-4, rtol=0)


def test_a_guard_never_drops_its_pinned_sinks_and_recent_rows(tiny_engine):
    request = rag(chunks=(20, 20))  # chunk rows 5-24 and 25-44, then the question
    tiny_engine.compile(request, ["naive"])
    policy = parse_method("guarded:1e-3:sinks=2:recent=6")
    plan = policy.plan(request, tiny_engine.lookup(request, policy))
    assert plan.pinned_rows.tolist() == [5, 6, 25, 26, 39, 40, 41, 42, 43, 44]
    plan.narrowing = [Narrowing(1, 0.0)]  # a check that drops every row it may
    seen: list[list[int]] = []
    tiny_engine.executor.run(plan, request.token_ids,
                             observer=lambda layer, q, rows, cache: seen.append(rows.tolist()))
    assert seen[0] == list(range(49))  # layer 0 computes every row; the check at layer 1 narrows
    assert seen[1] == seen[-1] == [*range(5), 5, 6, 25, 26, *range(39, 49)]  # prefix, pinned, question


CUE = [7, 8]  # e.g. the tokens of '\nSummary:' that every solved example and the question share


def few_shot(chunks_with_cue: int = 3, chunks: int = 3, tail: int = 0) -> Request:
    """Prefix rows 0-4, chunks of 20 rows (the cue at rows 10-11 of the first `chunks_with_cue`), then a
    question ending with the cue and `tail` template tokens after it."""
    def chunk(i: int) -> Segment:
        ids = random_ids(20, i + 1)
        ids[10:12] = CUE if i < chunks_with_cue else [9, 9]
        return Segment(SegmentKind.CHUNK, ids)
    question = [*random_ids(6, 99), *CUE, *[3] * tail]
    return Request([Segment(SegmentKind.PREFIX, random_ids(5, 0)), *(chunk(i) for i in range(chunks)),
                    Segment(SegmentKind.FRESH, question)], template_tail=tail)


def test_chunks_are_examples_when_most_of_them_hold_the_questions_ending():
    assert answers_like_examples(few_shot(), all_hits(few_shot()))
    assert answers_like_examples(few_shot(2, 4), all_hits(few_shot(2, 4)))  # half of them
    assert not answers_like_examples(few_shot(1, 3), all_hits(few_shot(1, 3)))  # one passage says it by chance
    tailed = few_shot(tail=4)  # the template's tail is not part of the question
    assert answers_like_examples(tailed, all_hits(tailed))
    assert not answers_like_examples(rag(), all_hits(rag()))


def test_an_empty_question_has_no_ending_even_when_every_chunk_ends_alike():
    """Documents sent with an empty user message (the instruction in the system prompt): the chunks all end
    with the same separator, which must not be taken for a question's cue that they share."""
    chunks = [Segment(SegmentKind.CHUNK, [*random_ids(18, i + 1), *CUE]) for i in range(3)]
    tail_only = Request([Segment(SegmentKind.PREFIX, random_ids(5, 0)), *chunks,
                         Segment(SegmentKind.FRESH, [3, 3, 3])], template_tail=3)
    assert tail_only.question_ending(CUE_TOKENS) == []
    assert not answers_like_examples(tail_only, all_hits(tail_only))
    ends_in_a_chunk = Request([Segment(SegmentKind.PREFIX, random_ids(5, 0)), *chunks])
    assert ends_in_a_chunk.question_ending(CUE_TOKENS) == []


def test_the_guard_recomputes_the_examples_nearest_a_few_shot_question_instead_of_deviating_rows():
    request = few_shot()  # chunk rows 5-24, 25-44, 45-64, then the question
    policy = parse_method("guarded:1e-3:sinks=2:examples=24")
    plan = policy.plan(request, all_hits(request))
    assert plan.narrowing == []  # no deviation check: the chosen rows run from layer 0 on, nothing else
    assert computed_chunk_rows(request, plan) == {1: [0, 1], 2: [0, 1, 16, 17, 18, 19], 3: list(range(20))}
    passages = rag()  # no shared ending: the deviation guard, its sinks pinned
    plan = policy.plan(passages, all_hits(passages))
    assert [n.max_residual for n in plan.narrowing] == [1e-3] and plan.pinned_rows.tolist() == [5, 6, 25, 26, 41, 42]


def test_a_plan_must_compute_its_pinned_rows():
    request = rag()
    plan = parse_method("legolink:2").plan(request, all_hits(request))
    with pytest.raises(ValueError, match="pinned rows must be computed"):
        FusionPlan(plan.method, plan.num_rows, plan.reused, plan.compute_rows, pinned_rows=torch.tensor([9]))


def check_with_weights(deviation: torch.Tensor, weights: torch.Tensor | None, max_residual: float) -> list[int]:
    """most_deviating on 8 chunk rows whose stored KV is zero but for a unit energy each: row j's recomputed
    key deviates by `deviation[j]`; returns the rows kept."""
    rows = deviation.numel()
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, capacity=rows)
    cache.allocate(torch.arange(rows))
    cache.keys[1][:rows] = torch.tensor([1.0, 0.0]).expand(rows, 1, 2)
    cache.values[1][:rows] = 0.0
    k = cache.keys[1][:rows].clone()
    k[:, 0, 1] = deviation.sqrt()
    keep, _ = most_deviating(Narrowing(1, 0.0, max_residual), rows, cache, torch.arange(rows), k,
                             cache.values[1][:rows].clone(), torch.ones(rows, dtype=torch.bool), weights)
    return keep.tolist()


def test_a_bf16_cache_s_deviation_is_summed_in_fp32():
    """One row whose K deviates by 1 on 256 dims and V by 1 on one: 257, which bf16 cannot hold (it rounds to 256)."""
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=258, dtype=torch.bfloat16, capacity=1)
    cache.allocate(torch.arange(1))
    cache.keys[1][:1], cache.values[1][:1] = 0.0, 0.0
    cache.keys[1][0, 0, 0] = 1.0  # the stored energy: 1
    k, v = cache.keys[1][:1].clone(), cache.values[1][:1].clone()
    k[0, 0, 1:257] += 1.0
    v[0, 0, 0] = 1.0
    _, check = most_deviating(Narrowing(1, 0.0), 1, cache, torch.arange(1), k, v, torch.ones(1, dtype=torch.bool))
    assert check.mass == 257.0


def test_a_query_aware_check_keeps_the_deviating_rows_the_question_attends_to():
    deviation = torch.tensor([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 4.0, 1.0])
    attention = torch.tensor([0.0, 0.01, 0.3, 0.01, 0.3, 0.01, 0.0, 0.37])
    assert check_with_weights(deviation, None, 0.7) == [0, 1, 6]  # unweighted: the largest deviations
    # weighted: rows 2, 4 and 7 carry 0.97 of the weighted deviation (the weighted energy is 1.0)
    assert check_with_weights(deviation, attention, 0.1) == [2, 4, 7]


def test_the_question_attention_is_that_of_the_rows_after_the_last_chunk(tiny_engine):
    model = tiny_engine.model
    rows, question = 12, [9, 10, 11]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, model.num_q_heads, model.head_dim, generator=gen)
    k = torch.randn(rows, model.num_kv_heads, model.head_dim, generator=gen)
    approximate = torch.tensor([False] * 2 + [True] * 7 + [False] * 3)
    got = question_attention(model, 1, q, torch.arange(rows), k, approximate)
    expected = model.attention_weights(1, q[question], torch.tensor(question), k, torch.arange(rows)).mean((0, 1))
    torch.testing.assert_close(got, expected.clamp_min(1e-6))


def test_a_query_aware_guard_weighs_its_check_and_at_zero_equals_full_prefill(tiny_engine):
    request = rag(chunks=(20, 20))
    tiny_engine.compile(request, ["naive"])
    query_aware, plain = (tiny_engine.executor.run(guarded_plan(tiny_engine, request, 0.0, method),
                                                   request.token_ids) for method in ("guarded-query", "guarded"))
    assert query_aware.stats.deviation_checks[0].kept == 40
    assert query_aware.stats.deviation_mass != pytest.approx(plain.stats.deviation_mass, rel=1e-3)
    torch.testing.assert_close(query_aware.logits, tiny_engine.prefill(request, "full").logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("spec, message", [("guarded:x", "not a number"), ("guarded:2", r"in \[0, 1\]"),
                                           ("guarded-query:-1", r"in \[0, 1\]")])
def test_bad_guard_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)
