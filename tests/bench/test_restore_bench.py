"""The restoration benchmark's ideal: the best split of the prefix between computing its front and loading its
back, from measured spans of each side."""

import pytest

from kvreuse.bench.restore import _paired, ideal_seconds


def test_ideal_splits_where_compute_of_the_front_meets_load_of_the_back():
    compute = [[0, 4, 0.4], [4, 8, 0.4]]  # 0.1 s per position
    load = [[0, 4, 0.1], [4, 8, 0.1]]  # 0.025 s per position: they cross at x = 1.6 (0.16 s each side)
    assert ideal_seconds(compute, load, remainder=0.05) == pytest.approx(0.16 + 0.05)


def test_ideal_is_never_worse_than_either_side_alone():
    compute, load = [[0, 8, 0.2]], [[0, 8, 5.0]]
    assert ideal_seconds(compute, load, 0.0) <= 0.2
    assert ideal_seconds([[0, 8, 5.0]], [[0, 8, 0.2]], 0.0) <= 0.2


def test_paired_ratio_keeps_what_a_repeat_s_variants_share_out_of_the_ratio():
    """Cake 5% slower than load-only in every repeat while the machine's speed changes between repeats: the
    paired ratio is 1.05; the ratio of medians depends on which repeats were slow for which variant."""
    speed = [1.0, 1.5, 1.0, 1.5, 1.5]
    load = [0.1 * s for s in speed]
    cake = [0.105 * s for s in speed]
    assert _paired(cake, load) == pytest.approx(1.05)
    assert _paired(load, load) == 1.0
