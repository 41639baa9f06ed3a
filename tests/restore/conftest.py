"""Restore tests run torch on one intra-op thread: on this 2-core machine, shared with other work, a second
OpenMP thread mostly waits at barriers for a core (tiny matmuls took 100x longer with two)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
