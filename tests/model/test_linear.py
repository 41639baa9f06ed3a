"""The runtime's matrix product equals nn.Linear's, for few rows (weight sliced per thread) and many."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvreuse.model.linear import FEW_ROWS, linear


@pytest.mark.parametrize("threads", [1, 2, 3])  # 3 does not divide 40 outputs: one slice
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_linear_equals_nn_linear(threads, rows, bias):
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 24)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = linear(x, layer)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, layer(x), atol=1e-5, rtol=1e-5)
