"""The turns every benchmark times its variants in."""

from __future__ import annotations

from kvreuse.bench.timing import interleaved_samples


def test_variants_take_turns_in_another_order_each_repeat():
    """Each repeat calls every variant once, in an order of its own: a variant that always ran right after full
    prefill (the slowest) was timed on a machine that had just run it."""
    names = list("abcdefgh")
    calls: list[str] = []
    variants = {name: (lambda name=name: calls.append(name) or name.upper()) for name in names}
    samples = interleaved_samples(variants, repeats=4)
    warm_up, turns = calls[: len(names)], [calls[len(names) * (i + 1): len(names) * (i + 2)] for i in range(4)]
    assert warm_up == names and all(sorted(turn) == names for turn in turns) and len(calls) == 5 * len(names)
    assert len({tuple(turn) for turn in turns}) == 4
    assert not all(turn.index("b") == turn.index("a") + 1 for turn in turns)
    assert all(len(samples[n].seconds) == 4 and samples[n].last == n.upper() for n in names)
