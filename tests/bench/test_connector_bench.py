"""bench connector's prompts: the spans it sends tile the reordered prompt, chunk by chunk, from its first token."""

from __future__ import annotations

from kvreuse.bench.connector import RagPrompt


def test_spans_cover_the_head_then_each_passage_in_its_new_order():
    prompt = RagPrompt(head=[1, 2], chunks=[[10, 11, 12], [20], [30, 31]], question=[9, 9], order=[2, 0, 1])
    assert prompt.reordered == [1, 2, 30, 31, 10, 11, 12, 20, 9, 9]
    spans = prompt.spans()
    assert spans == [[0, 2], [2, 4], [4, 7], [7, 8]]
    pieces = [prompt.reordered[a:b] for a, b in spans]
    assert pieces == [prompt.head] + [prompt.chunks[i] for i in prompt.order]
    stored = [r.ids for r in prompt.store_requests()]
    assert stored == [prompt.head, *prompt.chunks]  # each piece stored alone, at position 0
    assert prompt.reuse_request().kv_transfer_params == {"kvreuse_chunks": spans}
