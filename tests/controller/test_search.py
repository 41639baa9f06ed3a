"""Ratio selection on synthetic cost curves: no model, no timing."""

from __future__ import annotations

import math
import random

import pytest

from kvreuse.controller.search import GOLDEN, cacheblend_ratio, golden_section, roofline_ratio

FLOOR, CEILING, TOL = 0.15, 1.0, 0.01


def literal_algorithm1(f, r_min, r_max, r0, eps):
    """CacheTune's Algorithm 1 as printed (paper 000): r0 takes one probe slot, the golden updates follow, and
    the midpoint of the last bracket is returned."""
    a, b = r_min, r_max
    if r0 <= (a + b) / 2:
        x1, x2 = r0, a + GOLDEN * (b - a)
    else:
        x1, x2 = b - GOLDEN * (b - a), r0
    f1, f2 = f(x1), f(x2)
    for _ in range(200):  # as printed the loop may never close the bracket once the probes swap sides
        if abs(b - a) < eps:
            break
        if f1 < f2:
            b, x2, f2 = x2, x1, f1
            x1 = b - GOLDEN * (b - a)
            f1 = f(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + GOLDEN * (b - a)
            f2 = f(x2)
    return (a + b) / 2


def roofline(optimum: float, overhead: float = 0.0):
    """TTFT of CacheTune's eq. 10 in units where the slower path costs 1 at the optimum:
    max(r * t_c, (1 - r) * t_i) + t_o, with t_i / (t_c + t_i) = optimum."""
    return lambda r: max(r / optimum, (1 - r) / (1 - optimum)) + overhead


def quadratic(optimum: float):
    return lambda x: (x - optimum) ** 2


def asymmetric(optimum: float):
    """Gentle on the left, twenty times as steep on the right."""
    return lambda x: (optimum - x) if x < optimum else 20 * (x - optimum)


def flat_between(left: float, right: float):
    return lambda x: max(0.0, left - x, x - right)


@pytest.mark.parametrize("curve,optimum", [
    (quadratic(0.42), 0.42),
    (asymmetric(0.3), 0.3),
    (asymmetric(0.85), 0.85),
    (lambda x: math.exp(3 * x) - 8 * x, math.log(8 / 3) / 3),
    (lambda x: x, FLOOR),  # optimum at the lower end
    (lambda x: -x, CEILING),  # and at the upper end
    (roofline(0.37, overhead=0.2), 0.37),
])
@pytest.mark.parametrize("warm_start", [None, FLOOR, 0.5, 0.93, CEILING])
def test_finds_the_optimum_of_unimodal_curves(curve, optimum, warm_start):
    result = golden_section(curve, FLOOR, CEILING, warm_start=warm_start, tol=TOL)
    assert abs(result.x - optimum) <= TOL
    assert result.cost == min(cost for _, cost in result.evaluations) == curve(result.x)


def test_an_optimum_at_an_end_is_returned_exactly():
    assert golden_section(lambda x: x, FLOOR, CEILING).x == FLOOR
    assert golden_section(lambda x: -x, FLOOR, CEILING, warm_start=0.3).x == CEILING


def test_a_failed_measurement_is_never_the_best_point():
    """A calibration's one bad timing (NaN) at its warm start was kept as the best: min() keeps a NaN met first."""
    curve = roofline(0.7)
    result = golden_section(lambda x: math.nan if x == 0.15 else curve(x), FLOOR, CEILING, warm_start=0.15)
    assert math.isfinite(result.cost) and abs(result.x - 0.7) <= TOL
    with pytest.raises(ValueError, match="no point of the search had a finite cost"):
        golden_section(lambda x: math.nan, FLOOR, CEILING)


@pytest.mark.parametrize("warm_start", [None, 0.2, 0.55, 0.9])
def test_a_flat_bottom_returns_a_point_on_it(warm_start):
    result = golden_section(flat_between(0.4, 0.6), FLOOR, CEILING, warm_start=warm_start)
    assert result.cost == 0.0 and 0.4 <= result.x <= 0.6


@pytest.mark.parametrize("optimum", [FLOOR, 0.22, 0.5, 0.81])
def test_a_right_warm_start_on_a_roofline_is_kept_exactly(optimum):
    result = golden_section(roofline(optimum, overhead=0.1), FLOOR, CEILING, warm_start=optimum)
    assert result.x == optimum
    assert result.evaluations[0][0] == optimum  # the prior is measured first


@pytest.mark.parametrize("optimum,warm_start", [(0.3, FLOOR), (0.3, 0.95), (0.8, 0.16), (0.6, 0.2), (0.2, 0.7)])
def test_a_wrong_warm_start_still_finds_the_roofline_optimum(optimum, warm_start):
    result = golden_section(roofline(optimum), FLOOR, CEILING, warm_start=warm_start)
    assert abs(result.x - optimum) <= TOL


@pytest.mark.parametrize("optimum,warm_start", [
    (0.3, FLOOR),  # prior clipped to the floor: the probes swap sides and the bracket closes on the floor
    (0.3, 0.3),  # prior exactly right: the swapped probes drop the half that holds it
    (0.6, 0.6),
    (0.999, 0.95),  # loading-bound everywhere, prior near the top: the top is dropped
])
def test_the_literal_algorithm_loses_the_optimum_where_ours_finds_it(optimum, warm_start):
    curve = roofline(optimum) if optimum < 0.99 else (lambda r: 1 - r)
    best = curve(optimum)
    literal = literal_algorithm1(curve, FLOOR, CEILING, warm_start, TOL)
    ours = golden_section(curve, FLOOR, CEILING, warm_start=warm_start, tol=TOL)
    assert abs(literal - optimum) > 5 * TOL and curve(literal) > best + 0.1
    assert abs(ours.x - optimum) <= TOL and ours.cost <= best + 0.01


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("warm_start", [None, 0.25])
def test_noisy_curves_land_near_the_optimum(seed, warm_start):
    noise = random.Random(seed)
    clean = roofline(0.4, overhead=0.5)  # 1.5 at the optimum, 2.6 at the ends
    result = golden_section(lambda r: clean(r) * (1 + noise.uniform(-0.01, 0.01)), FLOOR, CEILING,
                            warm_start=warm_start)
    assert abs(result.x - 0.4) <= 0.02


@pytest.mark.parametrize("tol", [0.1, 0.01, 1e-4])
@pytest.mark.parametrize("warm_start", [None, FLOOR, 0.5, CEILING])
def test_evaluations_are_few_and_never_repeated(tol, warm_start):
    calls = []
    result = golden_section(lambda x: calls.append(x) or (x - 0.33) ** 2, FLOOR, CEILING, warm_start=warm_start,
                            tol=tol, max_evals=100)
    golden_steps = math.ceil(math.log(tol / (CEILING - FLOOR)) / math.log(GOLDEN))
    prior = 0 if warm_start is None else 2  # r0 and the golden point it is compared with
    assert len(calls) == len(set(calls)) == len(result.evaluations)
    assert len(calls) <= prior + 2 + golden_steps + 1  # fresh probes, one per step, one end
    assert [x for x, _ in result.evaluations] == calls


def test_max_evals_caps_the_evaluations_and_the_best_so_far_is_returned():
    calls = []
    result = golden_section(lambda x: calls.append(x) or abs(x - 0.7), FLOOR, CEILING, warm_start=0.7,
                            tol=1e-6, max_evals=5)
    assert len(calls) == 5 and result.x == 0.7


@pytest.mark.parametrize("kwargs,named", [
    (dict(lo=0.5, hi=0.5), "lo"),
    (dict(lo=0.9, hi=0.1), "lo"),
    (dict(hi=math.inf), "hi"),
    (dict(tol=0.0), "tol"),
    (dict(tol=-0.01), "tol"),
    (dict(max_evals=0), "max_evals"),
    (dict(warm_start=0.1), "warm_start"),
    (dict(warm_start=1.2), "warm_start"),
])
def test_bad_search_input_names_the_argument(kwargs, named):
    args = dict(lo=FLOOR, hi=CEILING) | kwargs
    with pytest.raises(ValueError, match=named):
        golden_section(lambda x: x, args.pop("lo"), args.pop("hi"), **args)


@pytest.mark.parametrize("t_c,t_i,expected", [
    (1.0, 1.0, 0.5),
    (3.0, 1.0, 0.25),
    (1.0, 0.01, FLOOR),  # memory: loading is nearly free, the quality floor decides
    (1.0, 0.0, FLOOR),
])
def test_roofline_ratio_is_the_crossover_clipped_to_the_floor(t_c, t_i, expected):
    assert roofline_ratio(t_c, t_i) == pytest.approx(expected)


def test_roofline_ratio_is_clipped_to_the_ceiling():
    assert roofline_ratio(1.0, 9.0, ceiling=0.6) == 0.6


@pytest.mark.parametrize("args,named", [((0.0, 1.0), "t_c"), ((1.0, -1.0), "t_i"), ((1.0, 1.0, 0.7, 0.5), "floor"),
                                        ((1.0, 1.0, -0.1), "floor"), ((1.0, 1.0, 0.1, 1.5), "ceiling")])
def test_roofline_ratio_bad_input_names_the_argument(args, named):
    with pytest.raises(ValueError, match=named):
        roofline_ratio(*args)


def per_layer_compute(r: float) -> float:
    """10 ms per layer at full recompute, 1 ms fixed."""
    return 0.001 + 0.009 * r


@pytest.mark.parametrize("load,expected", [(0.004, 1 / 3), (0.0073, 0.7)])
def test_cacheblend_ratio_recomputes_as_much_as_the_load_hides(load, expected):
    ratio = cacheblend_ratio(load, per_layer_compute)
    assert ratio == pytest.approx(expected, abs=1e-4)
    assert per_layer_compute(ratio) <= load  # the recompute still hides behind the load


def test_cacheblend_ratio_keeps_the_floor_when_loading_is_already_hidden():
    assert cacheblend_ratio(0.0015, per_layer_compute) == FLOOR
    assert cacheblend_ratio(0.0, per_layer_compute, floor=0.2) == 0.2


def test_cacheblend_ratio_recomputes_everything_when_loading_is_never_hidden():
    assert cacheblend_ratio(0.5, per_layer_compute) == 1.0


@pytest.mark.parametrize("args,named", [((-1.0, per_layer_compute), "load_seconds"),
                                        ((0.01, per_layer_compute, 1.5), "floor")])
def test_cacheblend_ratio_bad_input_names_the_argument(args, named):
    with pytest.raises(ValueError, match=named):
        cacheblend_ratio(*args)
