"""Test support: restore an axis with the two pointers meeting at a chosen position, deterministically; a store
that loses entries after the lookup."""

from __future__ import annotations

from kvreuse.restore.units import Axis, Span
from kvreuse.store.tiered import TieredStore


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


class Evicting(TieredStore):
    """A store whose entries `lost` disappear between the lookup and the load (evicted, or its server gone)."""

    lost: set[str] = set()

    def get_layers(self, key, start, stop):
        return None if key in self.lost else super().get_layers(key, start, stop)

    def view_layers(self, key, start, stop):
        return None if key in self.lost else super().view_layers(key, start, stop)

    def view_layers_picking(self, key, start, stop):
        return None if key in self.lost else super().view_layers_picking(key, start, stop)

    def get_rows(self, key, rows, layers=None):
        return None if key in self.lost else super().get_rows(key, rows, layers)
