"""Exactness of every reuse method on tiny random-weight models (fp32): the plans' limits and the masks."""

import pytest
import torch

from kvreuse.fusion.methods import parse_method, parse_method_list
from kvreuse.fusion.segments import Request, SegmentKind
from kvreuse.store.entry import EntryMeta, KVEntry

ALL_METHODS = ["full", "prefix", "naive", "cacheblend:0.15", "legolink:4", "legolink0", "cachetune:0.15"]
TOLERANCE = dict(atol=1e-4, rtol=0)


@pytest.fixture
def compiled(tiny_engine, rag_request):
    request = rag_request()
    tiny_engine.compile(request, ALL_METHODS)
    return tiny_engine, request


@pytest.mark.parametrize("method", ["cacheblend:1", "cachetune:1", "legolink:1000", "prefix"])
def test_methods_at_full_ratio_equal_full_prefill(compiled, method):
    engine, request = compiled
    full = engine.prefill(request, "full")
    torch.testing.assert_close(engine.prefill(request, method).logits, full.logits, **TOLERANCE)


@pytest.mark.parametrize("method", ["cacheblend:0", "cachetune:0", "legolink:0"])
def test_methods_at_zero_ratio_equal_naive(compiled, method):
    engine, request = compiled
    naive = engine.prefill(request, "naive")
    torch.testing.assert_close(engine.prefill(request, method).logits, naive.logits, **TOLERANCE)


def test_approximate_methods_differ_from_full(compiled):
    """The methods really reuse: naive reuse of chunks compiled alone does not give the full prefill."""
    engine, request = compiled
    full = engine.prefill(request, "full").logits
    for method in ["naive", "legolink0", "cacheblend:0.15", "legolink:4", "cachetune:0.15"]:
        assert (engine.prefill(request, method).logits - full).abs().max() > 1e-2, method


def test_single_chunk_at_offset_zero_gives_full_prefill_kv(tiny_engine, rag_request):
    request = rag_request(prefix=0, chunks=(40,))
    tiny_engine.compile(request, ["naive"])
    naive, full = tiny_engine.prefill(request, "naive"), tiny_engine.prefill(request, "full")
    for layer in range(tiny_engine.model.num_layers):
        torch.testing.assert_close(naive.cache.layer(layer)[0], full.cache.layer(layer)[0], **TOLERANCE)
        torch.testing.assert_close(naive.cache.layer(layer)[1], full.cache.layer(layer)[1], **TOLERANCE)
    torch.testing.assert_close(naive.logits, full.logits, **TOLERANCE)


def store_in_context_kv(engine, request: Request, method: str, ranking_seed: int) -> None:
    """Store each chunk's KV as computed in context (the full prefill's rows) with a random ranking. Reusing it is
    then exact, so recomputing *any* scattered subset of rows must give the full prefill again, which only an
    exact causal mask by position does (a bottom-right mask lets early selected rows see later keys)."""
    policy = parse_method(method)
    full = engine.model.prefill(request.token_ids, capture_kv=True)
    generator = torch.Generator().manual_seed(ranking_seed)
    for segment in request.segments:
        if segment.kind == SegmentKind.FRESH:
            continue
        rows = slice(segment.start, segment.start + len(segment.token_ids))
        meta = EntryMeta(engine.fingerprint, "float32", engine.model.num_layers, len(segment.token_ids),
                         policy.compile_mode, ranking=torch.rand(len(segment.token_ids), generator=generator))
        entry = KVEntry(engine.key_of(request, segment, policy), full.keys[:, rows].clone(), full.values[:, rows].clone(), meta)
        engine.store.put(entry)
    engine.store.flush()


@pytest.mark.parametrize("method", ["cachetune:0.3", "cachetune:0.8", "cacheblend:0.3", "legolink:5"])
def test_scattered_recomputed_rows_use_an_exact_causal_mask(tiny_engine, rag_request, method):
    # cachetune:0.8 selects over half the rows: attention then runs SDPA's causal kernel on padded queries
    request = rag_request()
    store_in_context_kv(tiny_engine, request, method, ranking_seed=7)
    out = tiny_engine.prefill(request, method)
    assert 0 < out.stats.fusion.recompute_share < 1
    torch.testing.assert_close(out.logits, tiny_engine.prefill(request, "full").logits, **TOLERANCE)


def test_request_ending_in_a_chunk_computes_its_last_row(tiny_engine, rag_request):
    request = rag_request(prefix=0, chunks=(20, 15), fresh=0)
    tiny_engine.compile(request, ["naive"])
    out = tiny_engine.prefill(request, "cachetune:1")
    torch.testing.assert_close(out.logits, tiny_engine.prefill(request, "full").logits, **TOLERANCE)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("magic", "unknown method 'magic'"),
        ("cacheblend:1.5", r"ratio must be in \[0, 1\]"),
        ("cachetune:-0.1", r"ratio must be in \[0, 1\]"),
        ("cacheblend:abc", "is not a number"),
        ("legolink:x", "whole number"),
        ("legolink:\u00b2", "whole number"),  # str.isdigit's digits that int() refuses
        ("legolink:\u0661\u0666", "whole number"),  # and those it takes: ASCII digits only
        ("naive:3", "takes no parameter"),
        ("cacheblend:0_1", "is not a number"),  # float() reads it as 1: a full recompute
        ("auto:0_1", "is not a number"),
        ("cachetune:\uff10.\uff11", "is not a number"),  # full-width digits: another name for 0.1
        ("guarded:inf", "is not a number"),
        ("auto:=0.1", "a floor is kl=X or agreement=X"),
        ("", "method: empty"),  # not the default, silently: None asks for that
        ("  ", "method: empty"),
    ],
)
def test_bad_method_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


@pytest.mark.parametrize("spec, value", [("cacheblend:.5", 0.5), ("cacheblend:1.", 1.0), ("cacheblend:+2e-1", 0.2),
                                         ("cachetune:1E-1", 0.1)])
def test_method_ratios_are_read_in_any_decimal_notation(spec, value):
    assert parse_method(spec).ratio == value


def test_a_method_list_starts_with_full_and_names_what_is_wrong():
    assert parse_method_list("naive,cacheblend:0.15") == ["full", "naive", "cacheblend:0.15"]
    assert parse_method_list("naive,full") == ["full", "naive"]
    for spec, message in [("full,,naive", "empty entry in 'full,,naive'"), ("naive,naive", "naive listed more than"),
                          ("naive,magic", "--methods: method: unknown method 'magic'")]:
        with pytest.raises(ValueError, match=message):
            parse_method_list(spec)
