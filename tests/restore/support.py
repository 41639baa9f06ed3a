"""Test support: restore an axis with the two pointers meeting at a chosen position, deterministically."""

from __future__ import annotations

from kvreuse.restore.units import Axis, Span


def restore_split(axis: Axis, split: int, compute_size: int = 3) -> None:
    """Positions [0, split) computed in spans of `compute_size` positions (cut where the axis cuts them) and
    [split, length) loaded piece by piece from the back, as the two pointers would claim them."""
    front = 0
    while front < split:
        stop = axis.compute_stop(front, compute_size, split)
        axis.compute(Span(front, stop))
        front = stop
    back = axis.length
    while back > split:
        start = axis.load_start(back, split)
        axis.place(Span(start, back), axis.read(Span(start, back)))
        back = start
