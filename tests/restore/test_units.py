"""The two-pointer claim logic: each side claims a unit once, the run ends where they meet, and the I/O side
may take over the compute side's last unit, whichever finishing first placing it."""

from kvreuse.restore.units import TwoPointer


def test_pointers_meet_without_claiming_a_unit_twice_per_side():
    pointers = TwoPointer(5)
    assert [pointers.claim_front(), pointers.claim_back(), pointers.claim_back()] == [0, 4, 3]
    assert pointers.settle(0) and pointers.settle(4) and pointers.settle(3)
    assert [pointers.claim_front(), pointers.claim_front(), pointers.claim_front()] == [1, 2, None]
    assert pointers.settle(1)
    # Nothing left to claim from the back: the I/O side takes over unit 2, once (the scheduler peeks first).
    assert pointers.peek_back() == 2
    assert pointers.claim_back() == 2 and pointers.claim_back() is None and pointers.peek_back() is None
    assert pointers.settle(2, lambda: None) and not pointers.settle(2)  # the compute side's result is dropped
    assert pointers.settled and 2 in pointers.done


def test_a_failed_load_is_recomputed_unless_the_compute_side_has_it():
    pointers = TwoPointer(3)
    assert pointers.claim_front() == 0 and pointers.claim_back() == 2 and pointers.claim_back() == 1
    assert pointers.fail(2)  # an ordinary unit: must be recomputed
    assert pointers.settle(1)
    assert pointers.claim_back() == 0
    assert not pointers.fail(0)  # the unit the compute side is on: left to it
    assert not pointers.settled
    assert pointers.settle(0)
    assert pointers.settled and pointers.failed == {2}
