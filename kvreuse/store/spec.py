"""`open_store(spec)`: a store from a textual description, tiers listed top (fastest) to bottom;
`parse_store_spec(spec)` reads one without opening anything.

Tier specs:
  memory:SIZE                    e.g. memory:2GB
  disk:PATH[:SIZE]               e.g. disk:/var/cache/kv:50GB (no SIZE: unlimited; ~ is the home folder; a
                                 PATH whose last ':' is followed by a digit, sign or point needs a SIZE after it)
  redis://HOST:PORT[/DB]         a Redis server (capacity: the server's maxmemory)
  throttled:DEVICE:TIER          TIER slowed to an emulated DEVICE (ssd, hdd, net10g), for benchmarks
  int8:TIER                      a disk or Redis TIER keeping entries in the lossy 8-bit form
Sizes: B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024).
A spec is a list of tier specs, or one string of them joined by commas.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from typing import Sequence
from urllib.parse import urlsplit

from redis.connection import parse_url

from kvreuse.store.base import KVStore
from kvreuse.store.disk import DiskTier
from kvreuse.store.memory import MemoryTier
from kvreuse.store.redis import RedisTier
from kvreuse.store.throttled import DEVICES, Device, ThrottledTier
from kvreuse.store.tiered import TieredStore

DEFAULT_STORE = "memory:4GB"  # the engine's, the server's and `kvreuse generate`'s store when none is given
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", re.IGNORECASE)
_PASSWORD = re.compile(r"(://[^/@]*?:)[^/@]*@")  # redis://user:PASSWORD@host


def _shown(spec: object) -> str:
    """A spec as an error message may show it: a Redis URL's password hidden (specs come from command lines and
    config files, errors go to logs and terminals)."""
    return _PASSWORD.sub(r"\1***@", repr(spec))


def parse_size(text: str) -> int:
    m = _SIZE.fullmatch(text)
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else 0.0
    size = int(value) if math.isfinite(value) else 0  # hundreds of digits: a float's infinity
    if size <= 0:
        raise ValueError(f"bad size {text!r}: expected a positive number with an optional unit, e.g. 2GB or 512MiB")
    return size


@dataclass(frozen=True)
class TierSpec:
    """One tier of a store spec, read: what `open_tier` builds. Reading opens nothing, so a command checks its
    spec when it starts, before a model loads."""

    kind: str  # memory, disk, redis, throttled
    text: str  # as written (an int8 tier's: the tier it keeps in that form)
    capacity: int | None = None  # bytes: memory's, and disk's (None: unlimited)
    path: str = ""  # disk: its folder, ~ expanded
    device: Device | None = None  # throttled: the emulated device
    inner: TierSpec | None = None  # throttled: the tier it slows
    quantize: bool = False  # int8: entries kept in the lossy 8-bit form


def parse_tier(spec: str) -> TierSpec:
    kind, _, rest = spec.partition(":")
    if kind == "int8":
        if rest.partition(":")[0] not in ("disk", "redis", "rediss"):
            raise ValueError(f"bad store spec {_shown(spec)}: int8 applies to disk and redis tiers")
        return replace(parse_tier(rest), quantize=True)
    if kind in ("redis", "rediss"):
        _check_redis_url(spec)
        return TierSpec("redis", spec)
    if kind == "memory" and rest:
        return TierSpec("memory", spec, capacity=_size_in(spec, rest))
    if kind == "disk" and rest:
        path, size = _disk_path_and_size(rest)
        # A shell leaves a ~ inside a word as it is (--store disk:~/kv): a folder named ~ under the working one
        return TierSpec("disk", spec, capacity=_size_in(spec, size) if size is not None else None,
                        path=os.path.expanduser(path))
    if kind == "throttled":
        device, _, inner = rest.partition(":")
        if device not in DEVICES or not inner:
            raise ValueError(f"bad store spec {_shown(spec)}: expected throttled:DEVICE:TIER, DEVICE in "
                             f"{sorted(DEVICES)}")
        return TierSpec("throttled", spec, device=DEVICES[device], inner=parse_tier(inner))
    raise ValueError(
        f"bad store spec {_shown(spec)}: expected memory:SIZE, disk:PATH[:SIZE], redis://HOST:PORT, "
        "throttled:DEVICE:TIER or int8:TIER"
    )


def _disk_path_and_size(rest: str) -> tuple[str, str | None]:
    """disk:PATH[:SIZE]'s path and size (None: unlimited)."""
    path, _, size = rest.rpartition(":")
    # A tail that starts like a number is a size, mistyped or not: taken as part of the path, "50XB" would make a
    # new directory "kv:50XB" of unlimited size.
    looks_like_a_size = size.lstrip()[:1] in "0123456789+-."
    if path and (not size or looks_like_a_size):
        return path, size
    if not path and size and looks_like_a_size:  # disk:5GB, disk::5GB: a size, no path; not a folder "5GB"
        raise ValueError(f"bad store spec 'disk:{rest}': expected disk:PATH[:SIZE], it names no path")
    return rest, None


def _size_in(spec: str, size: str) -> int:
    try:
        return parse_size(size)
    except ValueError as e:
        raise ValueError(f"bad store spec {_shown(spec)}: {e}") from None


def _check_redis_url(spec: str) -> None:
    url = urlsplit(spec)
    if not url.hostname:
        raise ValueError(f"bad store spec {_shown(spec)}: expected redis://HOST:PORT[/DB], it names no host")
    db = url.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"bad store spec {_shown(spec)}: the database after the port must be a number, got {db!r}")
    try:
        parse_url(spec)  # redis-py's own reading of it (a port that is not a number, a bad option), connecting to none
    except ValueError as e:
        raise ValueError(f"bad store spec {_shown(spec)}: {e}") from None


def parse_store_spec(spec: str | Sequence[str]) -> list[TierSpec]:
    """The tiers a spec names, top (fastest) first: a list of tier specs, or one string of them joined by commas."""
    if not isinstance(spec, (str, list, tuple)) or not all(isinstance(s, str) for s in spec):
        raise TypeError(f"store spec: expected text such as 'memory:4GB,disk:/var/kv', got {_shown(spec)}")
    specs = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    if not specs or not all(specs):
        raise ValueError(f"bad store spec {_shown(spec)}: no tiers named")
    return [parse_tier(s) for s in specs]


def open_tier(spec: str | TierSpec, *, create_folders: bool = True, **expect: str | bool | None) -> KVStore:
    """One tier; `create_folders=False`: a disk tier's folder must exist (inspecting a store creates nothing)."""
    tier = parse_tier(spec) if isinstance(spec, str) else spec
    if tier.kind == "redis":
        return RedisTier(tier.text, quantize=tier.quantize, **expect)
    if tier.kind == "memory":
        return MemoryTier(tier.capacity, **expect)
    if tier.kind == "disk":
        return DiskTier(tier.path, tier.capacity, create=create_folders, quantize=tier.quantize, **expect)
    return ThrottledTier(open_tier(tier.inner, create_folders=create_folders, **expect), tier.device)


def open_store(spec: str | Sequence[str], *, model_fingerprint: str | None = None, dtype: str | None = None,
               create_folders: bool = True) -> TieredStore:
    """Open the tiers named by `spec`. With model_fingerprint/dtype set, entries of any other model or dtype
    read as misses (and putting one is an error). `create_folders=False`: a disk tier's folder must exist."""
    return TieredStore([open_tier(tier, create_folders=create_folders, model_fingerprint=model_fingerprint,
                                  dtype=dtype) for tier in parse_store_spec(spec)])
