"""The store tiers a benchmark names on its command line, as store specs (see kvreuse/store/spec.py)."""

from __future__ import annotations

from kvreuse.store.throttled import DEVICES

# Emulated devices wrap the memory tier, so the device model, not this machine's disk, sets their read time.
TIER_SPECS = {
    "memory": "memory:8GB",
    "disk": "disk:{scratch}/disk",
    **{device: f"throttled:{device}:memory:8GB" for device in DEVICES},
}


def tier_spec(tier: str, scratch: str) -> str:
    """A known tier name's spec (disk under `scratch`); anything else is taken as a store spec already."""
    return TIER_SPECS.get(tier, tier).format(scratch=scratch)


def report_name(tier: str) -> str:
    """How a report names a tier: emulated devices say so, with their model."""
    return str(DEVICES[tier]) if tier in DEVICES else tier
