"""The fusion executor's placement of stored rows."""

from __future__ import annotations

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
