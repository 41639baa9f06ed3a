"""Bench prompts of a chosen length and number of chunks, from a dataset's passages or synthetic text."""

import pytest

from kvreuse.bench.workload import Shape, TextSource, build_workload
from kvreuse.fusion.segments import SegmentKind

from ..eval.support import DATASETS


@pytest.mark.parametrize("dataset", [None, str(DATASETS / "hotpotqa.jsonl")])
@pytest.mark.parametrize("shape", [Shape(256, 8), Shape(1024, 4), Shape(2048, 8), Shape(4096, 8)])
def test_prompt_has_the_asked_length_and_chunks(embedded_tokenizer, dataset, shape):
    workload = build_workload(embedded_tokenizer, TextSource(dataset), shape, 0, window=8192)
    chunks = workload.request.of_kind(SegmentKind.CHUNK)
    assert len(chunks) == shape.chunks
    assert shape.tokens - (shape.chunks + 2) <= len(workload.request) <= shape.tokens  # never past what was asked
    assert max(len(c.token_ids) for c in chunks) - min(len(c.token_ids) for c in chunks) <= 3


def test_prompts_of_one_shape_differ_and_fit_the_window(embedded_tokenizer):
    source = TextSource(str(DATASETS / "2wikimqa.jsonl"))
    first, second = (build_workload(embedded_tokenizer, source, Shape(8192, 2), i, window=8192) for i in (0, 1))
    assert first.prompt_ids != second.prompt_ids
    assert len(first.request) <= 8192 - 16


def test_peer_views_of_the_prompt(embedded_tokenizer):
    workload = build_workload(embedded_tokenizer, TextSource(None), Shape(512, 4), 0, window=8192)
    head, *chunks = [s.token_ids for s in workload.request.segments if s.kind != SegmentKind.FRESH]
    assert workload.exact_prefix_ids == head + chunks[0]
    assert workload.chunk_requests_ids == [head + c for c in chunks]
    assert workload.prompt_ids[: len(workload.exact_prefix_ids)] == workload.exact_prefix_ids


def test_too_many_chunks_for_the_length_is_an_error(embedded_tokenizer):
    with pytest.raises(ValueError, match="no room for 500 chunks"):
        build_workload(embedded_tokenizer, TextSource(None), Shape(256, 500), 0, window=8192)
