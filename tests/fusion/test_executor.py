"""The fusion executor's placement of stored rows."""

from __future__ import annotations

import torch

from kvreuse.fusion.executor import _as_slice


def test_only_rows_that_follow_one_another_are_placed_as_a_slice():
    assert _as_slice(torch.arange(4, 9)) == slice(4, 9)
    # same first and last row and count, but out of order: the rows' order is the loader's, so it must be kept
    assert isinstance(_as_slice(torch.tensor([4, 6, 5, 7])), torch.Tensor)
    assert isinstance(_as_slice(torch.tensor([0, 1, 3])), torch.Tensor)
    assert isinstance(_as_slice(torch.empty(0, dtype=torch.long)), torch.Tensor)
