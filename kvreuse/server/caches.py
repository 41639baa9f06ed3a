"""The context-cache API's registry: a cache id names a chunk's tokens within a tenant (cache salt).

The KV itself lives in the engine's store under its content key, so the same document sent in `documents`
reuses it too. An id is derived from the tenant and the tokens, so creating the same cache twice gives the same
id; another tenant's id reads as unknown. The registry keeps the MAX_CACHES used last (the KV as long as its
tier): an id past them reads as unknown, and creating the cache again gives it back.
"""

from __future__ import annotations

import array
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvreuse.store.keys import KEY_PATTERN

ID_PREFIX = "kvc-"
# Clients create caches at will, under any number of tenants: the registry is bounded. Its token ids are 4 bytes
# each (a tuple of ints took 36): at most 4096 x 8192 x 4 bytes, 134 MB, beside a store of gigabytes.
MAX_CACHES = 4096


@dataclass(frozen=True)
class ContextCache:
    id: str
    token_ids: array.array  # int32
    salt: str | None
    keys: tuple[str, ...]  # store keys of its compiled KV (one per compile mode compiled)
    created: int


def cache_id(token_ids: list[int], salt: str | None) -> str:
    digest = hashlib.sha256(repr((salt, list(token_ids))).encode()).hexdigest()
    return ID_PREFIX + digest[:32]


def is_cache_id(text: str) -> bool:
    return text.startswith(ID_PREFIX) and bool(KEY_PATTERN.fullmatch(text))


class CacheRegistry:
    def __init__(self, max_caches: int = MAX_CACHES):
        self._caches: OrderedDict[str, ContextCache] = OrderedDict()  # the one used last at the end
        self._lock = threading.Lock()
        self.max_caches = max_caches

    def add(self, token_ids: list[int], salt: str | None, keys: list[str]) -> ContextCache:
        cache = ContextCache(cache_id(token_ids, salt), array.array("i", token_ids), salt, tuple(keys),
                             int(time.time()))
        with self._lock:
            cache = self._caches.setdefault(cache.id, cache)
            self._caches.move_to_end(cache.id)
            while len(self._caches) > self.max_caches:
                self._caches.popitem(last=False)
            return cache

    def get(self, id_: str, salt: str | None) -> ContextCache | None:
        with self._lock:
            cache = self._caches.get(id_)
            if cache is None or cache.salt != salt:
                return None
            self._caches.move_to_end(id_)
            return cache

    def remove(self, id_: str, salt: str | None) -> ContextCache | None:
        with self._lock:
            cache = self._caches.get(id_)
            if cache is None or cache.salt != salt:
                return None
            return self._caches.pop(id_)
