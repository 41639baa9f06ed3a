"""The store tiers a benchmark names on its command line, as store specs (see kvreuse/store/spec.py)."""

from __future__ import annotations

import contextlib
import tempfile

from kvreuse.engine.reuse import ReuseEngine
from kvreuse.model.loader import LoadedModel
from kvreuse.store.redis_server import LocalRedis
from kvreuse.store.spec import open_store, parse_tier
from kvreuse.store.throttled import DEVICES

# Emulated devices wrap the memory tier, so the device model, not this machine's disk, sets their read time.
TIER_SPECS = {
    "memory": "memory:8GB",
    "disk": "disk:{scratch}/disk",
    **{device: f"throttled:{device}:memory:8GB" for device in DEVICES},
}


def check_tiers(text: str, redis: bool = True) -> list[str]:
    """The comma-separated tiers of a command line, each a name of TIER_SPECS (or "redis", where the command starts
    a private server) or a store spec (KIND:...): a misspelt name is refused when the command starts, not once the
    model has loaded and the run begins."""
    names = (*TIER_SPECS, "redis") if redis else tuple(TIER_SPECS)
    expected = f"expected {', '.join(names)} or a store spec such as disk:/var/kv"
    tiers = [tier.strip() for tier in text.split(",") if tier.strip()]
    if not tiers:
        raise ValueError(f"no tier named: {expected}")
    twice = next((tier for i, tier in enumerate(tiers) if tier in tiers[:i]), None)
    if twice is not None:
        raise ValueError(f"tier {twice!r} is named twice")
    unknown = [tier for tier in tiers if tier not in names and ":" not in tier]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r}: {expected}")
    for tier in tiers:
        if tier not in names:
            parse_tier(tier)  # a store spec's own mistakes, named now too
    return tiers


def tier_spec(tier: str, scratch: str) -> str:
    """A known tier name's spec (disk under `scratch`); anything else is taken as a store spec already."""
    return TIER_SPECS[tier].format(scratch=scratch) if tier in TIER_SPECS else tier  # a spec's braces are its own


def report_name(tier: str) -> str:
    """How a report names a tier: emulated devices say so, with their model."""
    return emulated_device(tier) or tier


def emulated_device(tier: str) -> str | None:
    """The emulated device a tier name stands for, with its model (what a figures file records), else None."""
    return str(DEVICES[tier]) if tier in DEVICES else None


def open_engines(loaded: LoadedModel, tiers: list[str], stack: contextlib.ExitStack, dtype: str = "float32",
                 redis_url: str | None = None) -> tuple[dict[str, ReuseEngine], dict[str, str]]:
    """One engine per tier, each over its own store, and the store spec each opened (for the report); `stack`
    closes them (their write-back threads) and removes the disk tier's scratch folder, even if a run fails. The
    redis tier is `redis_url`, or a private redis-server started here."""
    if not tiers:
        raise ValueError("--tiers: no tier named")
    scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvreuse-bench-"))
    engines, specs = {}, {}
    for tier in tiers:
        if tier == "redis":
            specs[tier] = redis_url or stack.enter_context(LocalRedis()).url
        else:
            specs[tier] = tier_spec(tier, scratch)
        store = open_store(specs[tier], model_fingerprint=loaded.fingerprint, dtype=dtype)
        engines[tier] = ReuseEngine(loaded, store)
        stack.callback(engines[tier].close)
    return engines, specs
