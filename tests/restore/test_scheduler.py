"""The batch-aware scheduler: requests restored together, admitted and finished independently, stay exact; the
I/O channel goes to the request with the most restoration work left."""

from __future__ import annotations

import torch

from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import PrefixRestorer
from kvreuse.restore.scheduler import BatchRestorer, Restoration, most_remaining
from kvreuse.restore.units import Span
from kvreuse.store import KeySpace, open_store

TOLERANCE = dict(atol=1e-4, rtol=0)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_batch_of_mixed_requests_restores_exactly(make_tiny):
    model = LayerwiseModel(make_tiny("mistral-window"))
    restorer = PrefixRestorer(model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    # (prompt, stored, strategy): mixed prefix lengths, both axes, one request with nothing stored.
    cases = [(60, 56, "cake"), (45, 16, "layerwise"), (30, 24, "cake"), (20, 0, "cake"), (48, 48, "layerwise")]
    prompts = [ids_of(n, seed) for seed, (n, _, _) in enumerate(cases)]
    for prompt, (_, stored, _) in zip(prompts, cases):
        if stored:
            restorer.store_prefix(prompt[:stored])
    batch = BatchRestorer(restorer)
    try:
        futures = [batch.submit(p, s) for p, (_, _, s) in zip(prompts[:4], cases)]
        results = [f.result(timeout=60) for f in futures]
        # admitted later, on its own, while nothing else runs
        results.append(batch.submit(prompts[4], cases[4][2]).result(timeout=60))
    finally:
        batch.close()
    for prompt, result in zip(prompts, results):
        full = model.prefill(prompt)
        torch.testing.assert_close(result.logits, full.logits, **TOLERANCE)
        for layer in range(model.num_layers):
            for got, want in zip(result.cache.layer(layer), full.cache.layer(layer)):
                torch.testing.assert_close(got, want, **TOLERANCE)
    assert [r.stats["prefix_tokens"] for r in results] == [56, 16, 24, 0, 47]


class FakeAxis:
    """`length` rows in blocks of 256, all on tier `tier`."""

    positions_per_token = 1
    token_layers = 30

    def __init__(self, length: int, tier: int = 0):
        self.length, self.tier_index = length, tier

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        return min(start + size, limit)

    def load_start(self, stop: int, limit: int) -> int:
        return max((stop - 1) // 256 * 256, limit)

    def tier(self, position: int) -> int:
        return self.tier_index


def test_io_goes_to_the_request_with_the_most_work_left():
    def request(length: int, tier: int = 0) -> Restoration:
        return Restoration(job=None, axis=FakeAxis(length, tier), strategy="cake", future=None, compute_run=256)

    short, long_, other_tier = request(512), request(1536), request(5120, tier=1)
    assert most_remaining([short, long_, other_tier], tier=0) is long_
    for _ in range(5):  # the long request's remaining work drops below the short one's
        long_.pointers.claim_back()
    assert most_remaining([short, long_, other_tier], tier=0) is short
    assert most_remaining([short, long_, other_tier], tier=1) is other_tier
    assert most_remaining([short], tier=1) is None


def test_compute_goes_to_the_request_with_the_least_work_left_and_finishing_comes_first():
    def request(length: int) -> Restoration:
        return Restoration(job=None, axis=FakeAxis(length), strategy="cake", future=None, compute_run=256)

    batch = BatchRestorer(restorer=None, compute_workers=0)  # no worker threads: the choice alone
    short, long_, done = request(512), request(1536), request(256)
    done.pointers.settle(done.pointers.claim_back(), seconds=0.01, computed=False)
    batch._active = [long_, short, done]
    assert batch._next_compute() == (done, None)  # all in place: its remainder is computed first
    assert batch._next_compute() == (short, Span(0, 256))
    assert batch._next_compute() == (long_, Span(0, 256))  # short is busy: a worker is on it
    assert batch._next_compute() is None
