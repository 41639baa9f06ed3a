"""The context-cache API's registry: a cache id names a chunk's tokens within a tenant (cache salt).

The KV itself lives in the engine's store under its content key, so the same document sent in `documents`
reuses it too. An id is derived from the tenant and the tokens, so creating the same cache twice gives the same
id; another tenant's id reads as unknown. The registry lives as long as the server (the KV as long as its tier).
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

from kvreuse.store.keys import KEY_PATTERN

ID_PREFIX = "kvc-"


@dataclass(frozen=True)
class ContextCache:
    id: str
    token_ids: tuple[int, ...]
    salt: str | None
    keys: tuple[str, ...]  # store keys of its compiled KV (one per compile mode compiled)
    created: int


def cache_id(token_ids: list[int], salt: str | None) -> str:
    digest = hashlib.sha256(repr((salt, list(token_ids))).encode()).hexdigest()
    return ID_PREFIX + digest[:32]


def is_cache_id(text: str) -> bool:
    return text.startswith(ID_PREFIX) and bool(KEY_PATTERN.fullmatch(text))


class CacheRegistry:
    def __init__(self):
        self._caches: dict[str, ContextCache] = {}
        self._lock = threading.Lock()

    def add(self, token_ids: list[int], salt: str | None, keys: list[str]) -> ContextCache:
        cache = ContextCache(cache_id(token_ids, salt), tuple(token_ids), salt, tuple(keys), int(time.time()))
        with self._lock:
            return self._caches.setdefault(cache.id, cache)

    def get(self, id_: str, salt: str | None) -> ContextCache | None:
        with self._lock:
            cache = self._caches.get(id_)
        return cache if cache is not None and cache.salt == salt else None

    def remove(self, id_: str, salt: str | None) -> ContextCache | None:
        with self._lock:
            cache = self._caches.get(id_)
            if cache is None or cache.salt != salt:
                return None
            return self._caches.pop(id_)
