"""The two-pointer claim logic: every position is claimed exactly once, by one side; the compute side claims
short runs, the I/O side whole stored blocks clipped at the compute side's pointer, so the two meet inside a
block; near the end the compute side claims no more than its share of the gap."""

import pytest

from kvreuse.restore.units import Rates, Span, SpanCost, TwoPointer


class BlockAxis:
    """Token-axis claim geometry: blocks of `block` positions, no work attached."""

    positions_per_token = 1
    token_layers = 2

    def __init__(self, length: int, block: int):
        self.length, self.block = length, block

    def compute_stop(self, start: int, size: int, limit: int) -> int:
        return min(start + size, limit)

    def load_start(self, stop: int, limit: int) -> int:
        return max((stop - 1) // self.block * self.block, limit)


def test_every_position_is_claimed_once_and_the_sides_meet_inside_a_block():
    pointers = TwoPointer(BlockAxis(40, 16), compute_run=4)
    claims = [pointers.claim_back(), pointers.claim_front(), pointers.claim_back(), pointers.claim_front()]
    assert claims == [Span(32, 40), Span(0, 4), Span(16, 32), Span(4, 8)]
    assert pointers.claim_back() == Span(8, 16)  # block 0 past the compute side's pointer: read in part
    assert pointers.claim_back() is None and pointers.claim_front() is None
    for span, computed in zip(claims + [Span(8, 16)], [False, True, False, True, False]):
        assert not pointers.settled
        pointers.settle(span, seconds=0.01, computed=computed)
    assert pointers.settled


def test_near_the_end_the_compute_side_claims_its_share_of_the_gap():
    pointers = TwoPointer(BlockAxis(400, 100), compute_run=32)
    pointers.settle(pointers.claim_front(), seconds=0.032, computed=True)  # 1000 positions/s
    pointers.settle(pointers.claim_back(), seconds=0.025, computed=False)  # 4000 positions/s
    # gap 268: at these rates the compute side's share is a fifth, ~54, more than a run: a whole run.
    assert pointers.claim_front() == Span(32, 64)
    pointers.claim_back()  # 200..300
    # gap 136: share 27 of the 32-position run
    assert pointers.claim_front() == Span(64, 91)


def test_the_compute_side_stops_when_its_share_is_under_a_quarter_run():
    # earlier restorations: loading is 100x faster than computing: a share of 400 / 101 ~ 4 < 32 / 4 positions
    pointers = TwoPointer(BlockAxis(400, 100), compute_run=32, prior=Rates(compute=1000.0, load=100_000.0))
    assert pointers.claim_front() is None
    assert pointers.claim_back() == Span(300, 400)  # the I/O side takes it all
    # comparable rates: the compute side claims a whole run
    assert TwoPointer(BlockAxis(400, 100), 32, Rates(1000.0, 2000.0)).claim_front() == Span(0, 32)


def test_a_failed_load_counts_as_settled_for_recomputation():
    pointers = TwoPointer(BlockAxis(8, 4), compute_run=4)
    compute, load = pointers.claim_front(), pointers.claim_back()
    pointers.fail(load)
    assert not pointers.settled
    pointers.settle(compute, seconds=0.01, computed=True)
    assert pointers.settled and pointers.failed == [Span(4, 8)]


def test_the_span_cost_fit_separates_a_fixed_cost_from_the_rate():
    cost = SpanCost()
    for n in (32, 8, 32, 16):  # 2 ms per span + 1000 positions/s
        cost.add(Span(0, n), 0.002 + n / 1000)
    fixed, rate = cost.fit()
    assert fixed == pytest.approx(0.002) and rate == pytest.approx(1000)
    one_size = SpanCost()
    one_size.add(Span(0, 32), 0.034)
    one_size.add(Span(32, 64), 0.034)
    assert one_size.fit() == (0.0, pytest.approx(32 / 0.034))  # indistinguishable: no fixed cost, the mean rate


def test_a_fixed_cost_per_span_shrinks_the_compute_side_s_share():
    # gap 400 at c=1000, l=4000: share 80 with no fixed cost; 20 ms per span is 80 positions the I/O side loads
    # meanwhile, leaving a share of (400 - 80) / 5 = 64
    assert TwoPointer(BlockAxis(400, 100), 128, Rates(1000.0, 4000.0)).claim_front() == Span(0, 80)
    assert TwoPointer(BlockAxis(400, 100), 128, Rates(1000.0, 4000.0, compute_fixed=0.02)).claim_front() == Span(0, 64)


def test_the_compute_side_stays_off_when_it_slows_the_loads_more_than_it_saves():
    # 32 positions save 8 ms of loading at 4000/s; the span takes 32 ms, during which loads run at half speed:
    # 16 ms of loading lost. Not worth it.
    slowed = Rates(compute=1000.0, load=4000.0, load_shared=2000.0)
    assert TwoPointer(BlockAxis(4000, 100), 32, slowed).claim_front() is None
    # loads barely slowed (10%): 3.2 ms lost < 8 ms saved
    assert TwoPointer(BlockAxis(4000, 100), 32, Rates(1000.0, 4000.0, load_shared=3600.0)).claim_front() == Span(0, 32)


def test_loads_that_run_beside_a_compute_span_are_timed_as_shared():
    pointers = TwoPointer(BlockAxis(400, 100), compute_run=32)
    loading = pointers.claim_back()  # 300..400, in flight when the compute side starts
    computing = pointers.claim_front()
    beside = pointers.claim_back()  # 200..300, claimed while computing
    pointers.settle(loading, seconds=0.05, computed=False)  # 2000/s
    pointers.settle(beside, seconds=0.05, computed=False)
    pointers.settle(computing, seconds=0.032, computed=True)
    alone = pointers.claim_back()  # 100..200, nothing computing
    pointers.settle(alone, seconds=0.025, computed=False)  # 4000/s
    rates = pointers.rates()
    assert rates.load_shared == pytest.approx(2000) and rates.load == pytest.approx(4000)
    assert rates.compute == pytest.approx(1000) and rates.compute_fixed == 0.0


def test_rates_not_measured_keep_the_earlier_ones():
    older = Rates(compute=1.0, load=2.0, compute_fixed=0.5, load_shared=1.5)
    assert Rates(load=3.0).merged_over(older) == Rates(1.0, 3.0, 0.5, 1.5)
