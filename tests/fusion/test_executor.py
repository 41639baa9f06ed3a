"""The fusion executor's placement of stored rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvreuse.fusion.executor import _as_slice


def test_only_rows_that_follow_one_another_are_placed_as_a_slice():
    assert _as_slice(torch.arange(4, 9)) == slice(4, 9)
    # same first and last row and count, but out of order: the rows' order is the loader's, so it must be kept
    assert isinstance(_as_slice(torch.tensor([4, 6, 5, 7])), torch.Tensor)
    assert isinstance(_as_slice(torch.tensor([0, 1, 3])), torch.Tensor)
    assert isinstance(_as_slice(torch.empty(0, dtype=torch.long)), torch.Tensor)


@pytest.mark.parametrize("method", ["full", "naive", "cacheblend:0.3"])
def test_a_plan_s_last_layer_finishes_only_the_prompt_s_last_row(tiny_engine, rag_request, method, finished_rows):
    """Every row a plan computes writes its KV at every layer; at the last one only the prompt's last row, whose
    logits are the result, goes on through the o-projection and MLP."""
    request = rag_request()
    tiny_engine.compile(request, [method])
    finished_rows.clear()
    tiny_engine.prefill(request, method)
    finished = [rows for _, rows in finished_rows]
    assert len(finished) == tiny_engine.model.num_layers and finished[-1] == 1 and min(finished[:-1]) > 1


def test_work_run_between_a_plan_s_layers_is_counted_apart_from_its_own_time(tiny_engine, rag_request):
    """A server's decoding steps between a prompt's layers are the prompt's paused_seconds, not its
    prefill_seconds (which the compute time the server reports and the restorer learns from are made of)."""
    import time

    request = rag_request()
    tiny_engine.compile(request, ["cacheblend:0.3"])
    pause, layers = 0.05, tiny_engine.model.num_layers
    started = time.perf_counter()
    with tiny_engine.model.between_layers(lambda: time.sleep(pause)):
        stats = tiny_engine.prefill(request, "cacheblend:0.3").stats.fusion
    wall = time.perf_counter() - started
    assert (layers - 1) * pause <= stats.paused_seconds < wall
    assert stats.prefill_seconds <= wall - stats.paused_seconds
    assert tiny_engine.prefill(request, "cacheblend:0.3").stats.fusion.paused_seconds == 0


def test_an_inline_loader_hands_out_a_read_s_layers_at_once_up_to_where_another_span_starts():
    """Inline, `take` hands out every layer the reads hold (INLINE_LAYERS_PER_READ of a span a read), placed in one
    call, but never past a layer where a span not loaded before starts loading (a prefix restored layer-wise): the
    layers handed out at once load the same rows. A loader thread hands out one layer at a time."""
    from kvreuse.fusion.executor import INLINE_LAYERS_PER_READ, LayerLoader
    from kvreuse.fusion.plan import ReusedSpan
    from kvreuse.store.entry import EntryMeta, KVEntry
    from kvreuse.store.keys import KeySpace, chunk_key
    from kvreuse.store.memory import MemoryTier

    layers, space, tier = INLINE_LAYERS_PER_READ + 2, KeySpace("test-model/float32", "test-tokenizer"), MemoryTier(None)
    entries = [KVEntry(chunk_key([i, 7], space), torch.randn(layers, 5, 2, 4), torch.randn(layers, 5, 2, 4),
                       EntryMeta("test-model", "float32", layers, 5)) for i in range(2)]
    for entry in entries:
        tier.put(entry)
    spans = [ReusedSpan(entries[0].key, 0, 5, torch.arange(5), True),
             ReusedSpan(entries[1].key, 5, 5, torch.arange(1, 5), True, from_layer=3)]
    form = (torch.float32, (2, 4))
    loader = LayerLoader(tier, spans, layers, form, layers_per_read=INLINE_LAYERS_PER_READ)
    handed, layer = [], 0
    while layer < layers:
        stored = loader.take(layer)
        handed.append((layer, stored.layers, len(stored.keys)))
        span_layers = slice(layer, layer + stored.layers)
        assert torch.equal(stored.keys[0], entries[0].k[span_layers])
        if len(stored.keys) > 1:  # rows 1..4 of the second entry: a run, lent as a view with nothing to pick
            assert stored.picks[1] is None and torch.equal(stored.values[1], entries[1].v[span_layers, 1:])
        loader.placed(stored.layers)
        layer += stored.layers
    assert handed == [(0, 3, 1), (3, INLINE_LAYERS_PER_READ - 3, 2), (INLINE_LAYERS_PER_READ, 2, 2)]
    assert loader.peak_layers_held == INLINE_LAYERS_PER_READ  # the layers handed out, and those read ahead
    with ThreadPoolExecutor(max_workers=1) as thread:
        threaded = LayerLoader(tier, spans, layers, form, thread)
        for layer in range(layers):
            assert threaded.take(layer).layers == 1
            threaded.placed(1)
