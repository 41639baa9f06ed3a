"""The batch-aware scheduler: requests restored together in batched compute steps, admitted and finished
independently, stay exact, lost blocks included; a step takes every request's next span; the I/O channel goes to
the request with the most restoration work left."""

from __future__ import annotations

import time

import pytest
import torch

from kvreuse.model.runtime import LayerwiseModel
from kvreuse.restore import PrefixRestorer
from kvreuse.restore.batch import (BatchRestorer, Restoration, auto_priority, io_turn, io_wait, key_weight,
                                      recompute_cost)
from kvreuse.restore.units import Rates, Span
from kvreuse.store import KeySpace, open_store

from .support import Evicting

TOLERANCE = dict(atol=1e-4, rtol=0)


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_full_prefill(model, prompt, result) -> None:
    full = model.prefill(prompt)
    torch.testing.assert_close(result.logits, full.logits, **TOLERANCE)
    for layer in range(model.num_layers):
        for got, want in zip(result.cache.layer(layer), full.cache.layer(layer)):
            torch.testing.assert_close(got, want, **TOLERANCE)


@pytest.mark.parametrize("compute_workers,io_priority",
                         [(1, "most-work"), (2, "most-work"), (1, "most-recompute"), (2, "least-work"), (1, "auto")])
def test_a_batch_of_mixed_requests_restores_exactly(make_tiny, compute_workers, io_priority):
    model = LayerwiseModel(make_tiny("mistral-window"))
    restorer = PrefixRestorer(model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    # (prompt, stored, strategy): mixed prefix lengths, both axes, one request with nothing stored.
    cases = [(60, 56, "cake"), (45, 16, "layerwise"), (30, 24, "cake"), (20, 0, "cake"), (48, 48, "layerwise")]
    prompts = [ids_of(n, seed) for seed, (n, _, _) in enumerate(cases)]
    for prompt, (_, stored, _) in zip(prompts, cases):
        if stored:
            restorer.store_prefix(prompt[:stored])
    batch = BatchRestorer(restorer, compute_workers, io_priority)
    try:
        futures = [batch.submit(p, s) for p, (_, _, s) in zip(prompts[:4], cases)]
        results = [f.result(timeout=60) for f in futures]
        # admitted later, on its own, while nothing else runs
        results.append(batch.submit(prompts[4], cases[4][2]).result(timeout=60))
    finally:
        batch.close()
    for prompt, result in zip(prompts, results):
        assert_full_prefill(model, prompt, result)
    assert [r.stats["prefix_tokens"] for r in results] == [56, 16, 24, 0, 47]


def test_a_request_s_times_count_its_look_up_as_a_lone_restoration_s_do(tiny_model, monkeypatch):
    """Its clock starts where PrefixRestorer.restore's starts, before the stored blocks are looked up."""
    restorer = PrefixRestorer(tiny_model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    prompt = ids_of(40, 0)
    restorer.store_prefix(prompt[:32])
    look_up = restorer.blocks_to_restore

    def slow_look_up(*args, **kwargs):
        time.sleep(0.2)
        return look_up(*args, **kwargs)

    monkeypatch.setattr(restorer, "blocks_to_restore", slow_look_up)
    batch = BatchRestorer(restorer, 1, "auto")
    try:
        result = batch.submit(prompt, "cake").result(timeout=60)
    finally:
        batch.close()
    assert result.stats["total_seconds"] >= 0.2 and result.stats["restore_seconds"] >= 0.2


def test_every_family_restores_a_mixed_batch_with_lost_blocks_exactly(tiny_model):
    """Cake and layer-wise requests in one batch, two of them losing their back block (the first the I/O side
    asks for) after the lookup: the failed spans are recomputed and every result is a full prefill's."""
    store = Evicting(open_store("memory:64MB").tiers)
    # short compute runs: many batched steps, and the I/O side reaches the lost blocks long before compute does
    restorer = PrefixRestorer(tiny_model, store, KeySpace("tiny", "tok"), block_size=8, compute_run=4)
    cases = [(50, 48, "cake"), (41, 40, "layerwise"), (33, 24, "layerwise"), (27, 16, "cake")]
    prompts = [ids_of(n, 10 + seed) for seed, (n, _, _) in enumerate(cases)]
    for prompt, (_, stored, _) in zip(prompts, cases):
        restorer.store_prefix(prompt[:stored])
    store.lost = {restorer.block_keys(prompts[i])[cases[i][1] // 8 - 1] for i in (0, 1)}
    batch = BatchRestorer(restorer)
    try:
        results = [f.result(timeout=60) for f in [batch.submit(p, s) for p, (_, _, s) in zip(prompts, cases)]]
    finally:
        batch.close()
    for prompt, result in zip(prompts, results):
        assert_full_prefill(tiny_model, prompt, result)
    assert results[0].stats["spans_failed"] and results[1].stats["spans_failed"]


def test_requests_finishing_in_one_step_share_one_lm_head_call(tiny_model, monkeypatch):
    """Three requests with nothing stored are all in place at admission, so the first step finishes them all:
    one LM-head call on their last rows, and each gets its own first-token logits."""
    restorer = PrefixRestorer(tiny_model, open_store("memory:16MB"), KeySpace("tiny", "tok"), block_size=8)
    batch = BatchRestorer(restorer, compute_workers=0)  # the test runs the step itself
    prompts = [ids_of(n, 30 + n) for n in (5, 17, 11)]
    futures = [batch.submit(p) for p in prompts]
    rows_per_call, logits = [], tiny_model.logits
    monkeypatch.setattr(tiny_model, "logits", lambda hidden: rows_per_call.append(len(hidden)) or logits(hidden))
    with torch.inference_mode():
        batch._step(batch._next_step())
    monkeypatch.undo()
    assert rows_per_call == [3]
    for prompt, future in zip(prompts, futures):
        assert_full_prefill(tiny_model, prompt, future.result(timeout=0))
    batch.close()


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
    assert io_turn([short, long_, other_tier], tier=0) is long_
    assert io_turn([short, long_, other_tier], tier=0, priority="least-work") is short
    for _ in range(5):  # the long request's remaining work drops below the short one's
        long_.pointers.claim_back()
    assert io_turn([short, long_, other_tier], tier=0) is short
    assert io_turn([short, long_, other_tier], tier=1) is other_tier
    assert io_turn([short], tier=1) is None


def test_auto_priority_serves_the_shortest_first_where_loading_outpaces_compute():
    def request(length: int) -> Restoration:
        return Restoration(job=None, axis=FakeAxis(length), strategy="cake", future=None, compute_run=256)

    short, long_ = request(512), request(1536)
    loads_faster, computes_faster = Rates(compute=1000.0, load=8000.0), Rates(compute=8000.0, load=1000.0)
    assert io_turn([short, long_], 0, "auto", lambda r: loads_faster) is short
    assert io_turn([short, long_], 0, "auto", lambda r: computes_faster) is long_  # CacheFlow's rule
    assert io_turn([short, long_], 0, "auto", lambda r: Rates()) is long_  # nothing measured yet: CacheFlow's
    assert auto_priority(Rates(compute=1000.0)) == "most-work"


def test_a_request_far_back_in_the_channel_s_queue_computes_where_a_lone_one_would_just_load():
    # loading 8x faster than computing: alone, a 512-row request's compute share is ~57 rows, under a quarter
    # of its 256-row run, so it would only load; behind 4608 rows of other requests' loading it computes
    loads_faster = Rates(compute=1000.0, load=8000.0)

    def request(length: int, tier: int = 0) -> Restoration:
        return Restoration(job=None, axis=FakeAxis(length, tier), strategy="cake", future=None, compute_run=256,
                           prior=loads_faster)

    short, long_, other_tier = request(512), request(4608), request(9000, tier=1)
    batch = [short, long_, other_tier]
    assert io_wait(batch, short, "least-work") == 0.0  # served first
    assert io_wait(batch, long_, "least-work") == pytest.approx(512 / 8000)
    assert io_wait(batch, short, "most-work") == pytest.approx(4608 / 8000)  # the other tier's queue is not its
    assert short.pointers.claim_front(io_wait(batch, short, "least-work")) is None
    assert short.pointers.claim_front(io_wait(batch, short, "most-work")) == Span(0, 256)
    assert io_wait(batch, short, "auto") == 0.0  # auto: shortest first, since this tier loads faster


def test_remaining_recompute_prices_the_back_of_a_long_prefix_highest():
    # 300 unclaimed rows at the back of a 1300-row prefix against 400 at the front of another: the second has
    # more rows left, the first costs more to recompute once attention over the rows before is counted.
    back, front = (Restoration(job=None, axis=FakeAxis(n), strategy="cake", future=None, key_weight=0.01)
                   for n in (1300, 400))
    while len(back.pointers.unclaimed()) > 300:
        back.pointers.claim_front()
    assert io_turn([back, front], tier=0) is front
    assert io_turn([back, front], tier=0, priority="most-recompute") is back


def test_recompute_cost_counts_each_row_and_the_rows_before_it():
    assert recompute_cost(Span(2, 5), rows=10, weight=0.5) == 3 + 0.5 * (2 + 3 + 4)
    # layer-major positions of 4 rows a layer: 3..8 are rows 3 | 0 1 2 3 | 0
    assert recompute_cost(Span(3, 9), rows=4, weight=1.0) == 6 + (3 + 0 + 1 + 2 + 3 + 0)
    assert recompute_cost(Span(5, 5), rows=4, weight=1.0) == 0


def test_key_weight_is_attention_flops_over_the_layer_weights(tiny_model):
    layer_weights = sum(p.numel() for p in tiny_model.layers[0].parameters())
    weight = key_weight(tiny_model)
    assert weight * 2 * layer_weights == 4 * tiny_model.num_q_heads * tiny_model.head_dim


def fake_request(length: int) -> Restoration:
    return Restoration(job=None, axis=FakeAxis(length), strategy="cake", future=None, compute_run=256)


def test_a_step_takes_every_request_and_finishing_comes_first():
    batch = BatchRestorer(restorer=None, compute_workers=0)  # no worker threads: the choice alone
    short, long_, done = fake_request(512), fake_request(1536), fake_request(256)
    done.pointers.settle(done.pointers.claim_back(), seconds=0.01, computed=False)
    batch._active = [long_, short, done]
    # all in place: its remainder goes in the step; every other request's next span too (Algorithm 1, line 11)
    assert batch._next_step() == [(done, None), (short, Span(0, 256)), (long_, Span(0, 256))]
    assert batch._next_step() is None  # all of them are in a step


def test_a_request_admitted_during_a_step_joins_the_next():
    batch = BatchRestorer(restorer=None, compute_workers=0)
    first, second, late = fake_request(512), fake_request(1024), fake_request(1024)
    batch._active = [first, second]
    assert batch._next_step() == [(first, Span(0, 256)), (second, Span(0, 256))]
    batch._active.append(late)  # admitted while that step runs
    for request in (first, second):  # the step is over
        request.busy = False
    batch._stepping = 0
    assert batch._next_step() == [(first, Span(256, 512)), (second, Span(256, 512)), (late, Span(0, 256))]


def test_several_workers_split_the_batch_least_work_first():
    batch = BatchRestorer(restorer=None, compute_workers=0)
    batch.compute_workers = 2  # the choice alone, as two workers would make it
    requests = [fake_request(n) for n in (2048, 512, 1536, 1024)]
    batch._active = list(requests)
    assert batch._next_step() == [(requests[1], Span(0, 256)), (requests[3], Span(0, 256))]
    assert batch._next_step() == [(requests[2], Span(0, 256)), (requests[0], Span(0, 256))]


def test_workers_release_their_idle_openmp_workers_before_they_wait(make_tiny, monkeypatch):
    """A restorer lives as long as its engine; its compute worker's idle OpenMP team would slow every other thread's
    parallel work (the server's decoding) until then: it releases the team before each wait for work."""
    import threading
    import time

    from kvreuse.restore import batch as batch_module

    released = []
    monkeypatch.setattr(batch_module.native, "release_idle_threads",
                        lambda: released.append(threading.current_thread().name))
    model = LayerwiseModel(make_tiny("llama"))
    restorer = PrefixRestorer(model, open_store("memory:64MB"), KeySpace("tiny", "tok"), block_size=8)
    prompt = ids_of(40, 1)
    restorer.store_prefix(prompt[:32])
    batch = BatchRestorer(restorer)
    try:
        batch.submit(prompt, "cake").result(timeout=60)
        # the future resolves inside the worker's step: it waits again (and releases) a moment later
        deadline = time.monotonic() + 30
        while released.count("restore-compute-0") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        computed_and_idle = released.count("restore-compute-0")
    finally:
        batch.close()
    assert computed_and_idle >= 2  # idle before the request came, and again once it was restored
