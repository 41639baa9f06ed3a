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
def test_a_plan_s_last_layer_finishes_only_the_prompt_s_last_row(tiny_engine, rag_request, method, monkeypatch):
    """Every row a plan computes writes its KV at every layer; at the last one only the prompt's last row, whose
    logits are the result, goes on through the o-projection and MLP."""
    request = rag_request()
    tiny_engine.compile(request, [method])
    model = tiny_engine.model
    finished = []
    finish = type(model).finish_layer
    monkeypatch.setattr(type(model), "finish_layer",
                        lambda self, layer, residual, out: finished.append(residual.shape[0])
                        or finish(self, layer, residual, out))
    tiny_engine.prefill(request, method)
    assert len(finished) == model.num_layers and finished[-1] == 1 and min(finished[:-1]) > 1
