"""Redis tier: entries shared between machines through a real Redis server.

An entry's bytes are split into parts of at most `part_size` (4 MB default: Redis handles values of that size
well, and a partial read fetches only the parts it touches, via GETRANGE). Parts live under a per-write
version, and a small manifest `PREFIX:m:KEY` = "version:size:part_size" names the live version. A put writes
its parts first and swaps the manifest last (SET ... GET): readers and concurrent writers see one whole
version. The parts a swap replaced or a delete dropped expire after a grace period rather than at once, so a
reader that fetched the old manifest a moment earlier still finds them; parts not yet named by a manifest
expire too, so a write that fails half-way leaves nothing behind for long. Capacity is the server's business
(maxmemory + an LRU policy); a part evicted under a live manifest reads as damage, hence a miss.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from typing import Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvreuse.store.base import BlobTier, TierUnavailable
from kvreuse.store.codec import Buffer, ByteSource, EntryDamaged, Range, scatter
from kvreuse.store.keys import KEY_PATTERN

DEFAULT_PART_SIZE = 4 << 20
REPLACED_PARTS_TTL_S = 30  # far longer than any read, short enough not to hold memory
UNCOMMITTED_PARTS_TTL_S = 600  # far longer than any write
OUTAGE_PAUSE_S = 5.0  # a hung server is asked again after this; between, its calls cost nothing
# A manifest naming more parts is damaged: acting on it (listing a billion part names to read or drop) would
# hang the reader or exhaust its memory. 65,536 parts of the default 4 MB hold 256 GB, far beyond any entry.
MAX_PARTS = 1 << 16
MANIFEST = re.compile(rb"(?P<version>[0-9a-f]{16}):(?P<size>[0-9]{1,15}):(?P<part_size>[0-9]{1,15})")


def _is_wrong_type(error: redis.ResponseError) -> bool:
    return "WRONGTYPE" in str(error)  # a pipeline prefixes it with the failing command


@contextlib.contextmanager
def wrong_type_is_damage() -> Iterator[None]:
    """A key of ours holding another Redis type (a list where a manifest or part should be) is damage, not an
    outage: the entry is then dropped and stored again by the next put, instead of missing forever."""
    try:
        yield
    except redis.ResponseError as e:
        if _is_wrong_type(e):
            raise EntryDamaged(f"a value of another type: {e}") from e
        raise


class RedisSource(ByteSource):
    def __init__(self, client: redis.Redis, part_prefix: str, size: int, part_size: int):
        self.client, self.part_prefix, self.size, self.part_size = client, part_prefix, size, part_size
        self.identity = (part_prefix, size, part_size)  # the prefix names the entry's version: new on every write

    def _fetch(self, spans: list[Range]) -> list[bytes]:
        return [b"".join(pieces) for pieces in self._fetch_pieces(spans)]

    def _fetch_into(self, spans: list[Range], buffers: list[list[Buffer]]) -> None:
        for span, pieces, span_buffers in zip(spans, self._fetch_pieces(spans), buffers, strict=True):
            scatter(span, pieces, span_buffers)  # not joined first: one copy fewer

    def _fetch_pieces(self, spans: list[Range]) -> list[list[bytes]]:
        """One pipelined round trip: a GETRANGE for each part a span touches; each span's pieces in order.
        A missing part reads as b"", so its span comes back short, which the caller treats as damage."""
        pipe = self.client.pipeline(transaction=False)
        pieces_per_span = []
        for off, n in spans:
            pieces = self._pieces(off, n)
            pieces_per_span.append(len(pieces))
            for part, start, stop in pieces:
                pipe.getrange(f"{self.part_prefix}{part}", start, stop - 1)
        with wrong_type_is_damage():
            results = iter(pipe.execute())
        return [[next(results) for _ in range(count)] for count in pieces_per_span]

    def _pieces(self, off: int, n: int) -> list[tuple[int, int, int]]:
        """(part, start, stop) byte spans inside parts covering [off, off + n)."""
        P = self.part_size
        return [(p, max(off, p * P) - p * P, min(off + n, (p + 1) * P) - p * P)
                for p in range(off // P, -(-(off + n) // P))]


class RedisTier(BlobTier):
    backend_errors = (OSError, redis.RedisError)
    outage_errors = (OSError, redis.ConnectionError, redis.TimeoutError)  # not a refused write (OOM) or damage
    reads_wait = True  # a round trip to the server per read

    def __init__(self, url: str, *, prefix: str = "kvreuse", part_size: int = DEFAULT_PART_SIZE,
                 timeout: float = 2.0, outage_pause: float = OUTAGE_PAUSE_S, quantize: bool = False,
                 **expect: str | None):
        """timeout: seconds a call waits for the server; outage_pause: seconds the tier answers misses without
        asking a server that failed to answer (refused or timed out) before it tries again."""
        # No retries: a dead server must cost one failure per call, not a backoff loop on the request path.
        # 1 MB socket reads: values are MBs, and the 32 kB default makes the pure-Python parser loop 30x more.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           socket_read_size=1 << 20, retry=Retry(NoBackoff(), 0))
        # The name shows up in logs and stats: host, port, db and whether over TLS (rediss), never a password.
        c = self.client.connection_pool.connection_kwargs
        host = f"[{c.get('host')}]" if ":" in str(c.get("host")) else c.get("host")  # an IPv6 address
        tls = " (tls)" if url.startswith("rediss:") else ""
        super().__init__(f"redis://{host}:{c.get('port')}/{c.get('db', 0)}{tls}", quantize=quantize,
                         outage_pause=outage_pause, **expect)
        self.prefix = prefix
        self.part_size = part_size

    def is_outage(self, error: BaseException) -> bool:
        # A database the server does not have (redis://HOST:PORT/99 on a server of 16) fails every call alike:
        # redis-py raises the server's reply to connecting as a ResponseError, not a ConnectionError.
        return super().is_outage(error) or (isinstance(error, redis.ResponseError) and "DB index" in str(error))

    def _manifest(self, key: str) -> str:
        return f"{self.prefix}:m:{key}"

    def _part_prefix(self, key: str, version: str) -> str:
        return f"{self.prefix}:p:{key}:{version}:"

    def _parse_manifest(self, raw: bytes) -> tuple[str, int, int]:
        match = MANIFEST.fullmatch(raw)
        if match is None:
            raise EntryDamaged(f"bad manifest {raw[:64]!r}")
        size, part_size = int(match["size"]), int(match["part_size"])
        if size < 1 or part_size < 1 or -(-size // part_size) > MAX_PARTS:
            raise EntryDamaged(f"manifest {raw[:64]!r} claims {size} bytes in parts of {part_size}: out of bounds")
        return match["version"].decode(), size, part_size

    def _part_keys(self, key: str, manifest: bytes) -> list[str]:
        version, size, part_size = self._parse_manifest(manifest)
        return [f"{self._part_prefix(key, version)}{i}" for i in range(-(-size // part_size))]

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[RedisSource | None]:
        with wrong_type_is_damage():
            raw = self.client.get(self._manifest(key))
        if raw is None:
            yield None
            return
        version, size, part_size = self._parse_manifest(raw)
        yield RedisSource(self.client, self._part_prefix(key, version), size, part_size)

    def _exists(self, key: str) -> bool:
        return self.client.type(self._manifest(key)) == b"string"  # a list or hash there is damage, not an entry

    def _write(self, key: str, data: bytes) -> None:
        version = uuid.uuid4().hex[:16]
        parts = self._part_prefix(key, version)
        names = [f"{parts}{i}" for i in range(-(-len(data) // self.part_size))]
        pipe = self.client.pipeline(transaction=False)
        for i, name in enumerate(names):
            # Parts expire until the manifest naming them is set: a write that dies before it (the server gone,
            # a timeout, this process killed) leaves nothing that no manifest names and no clear would find.
            pipe.set(name, data[i * self.part_size : (i + 1) * self.part_size], ex=UNCOMMITTED_PARTS_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError:
            # e.g. OOM under maxmemory: drop the parts now rather than at their expiry (the server may be gone).
            with contextlib.suppress(redis.RedisError):
                self.client.delete(*names)
            raise
        commit = self.client.pipeline(transaction=True)  # the manifest and its parts' persistence at once
        commit.set(self._manifest(key), f"{version}:{len(data)}:{self.part_size}", get=True)
        for name in names:
            commit.persist(name)
        try:
            old = commit.execute()[0]
        except redis.ResponseError as e:
            # A transaction runs its other commands past a failed one: the parts were made to persist, and no
            # manifest names them. A value of another type under the manifest's name is damage: dropped, so that
            # the next put stores the entry.
            with contextlib.suppress(redis.RedisError):
                self.client.delete(*names, *([self._manifest(key)] if _is_wrong_type(e) else []))
            raise
        if old is not None:
            self._drop_parts(key, old)

    def _drop_parts(self, key: str, manifest: bytes) -> None:
        """Let the parts `manifest` names expire: a reader that fetched the manifest a moment earlier still finds
        them (deleted at once, it would see a missing part, report damage and drop the key, perhaps a newer entry
        written under it meanwhile)."""
        with contextlib.suppress(EntryDamaged):
            parts = self._part_keys(key, manifest)
            pipe = self.client.pipeline(transaction=False)
            for name in parts:
                pipe.expire(name, REPLACED_PARTS_TTL_S)
            pipe.execute()

    def _remove(self, key: str) -> bool:
        try:
            old = self.client.getdel(self._manifest(key))
        except redis.ResponseError as e:
            if not _is_wrong_type(e):
                raise
            return bool(self.client.delete(self._manifest(key)))  # damage of another type: nothing else to drop
        if old is None:
            return False
        self._drop_parts(key, old)
        return True

    def keys(self) -> Iterator[str]:
        start = len(self._manifest(""))
        try:
            names = list(self.client.scan_iter(match=self._manifest("*"), count=1000))
        except self.backend_errors as e:
            raise TierUnavailable(f"{self.name}: cannot list its entries: {e}") from e
        keys = (name.decode(errors="replace")[start:] for name in names)
        return (key for key in keys if KEY_PATTERN.fullmatch(key))  # a stray name there is not an entry

    def usage(self) -> dict[str, int]:
        if self.in_outage():
            return {}
        try:
            manifests = [m for m in self.client.mget([self._manifest(k) for k in self.keys()] or [""]) if m]
        except (TierUnavailable, *self.backend_errors):
            return {}
        sizes = []
        for manifest in manifests:
            with contextlib.suppress(EntryDamaged):  # one damaged manifest must not blank the tier's figures
                sizes.append(self._parse_manifest(manifest)[1])
        return {"entries": len(sizes), "bytes_used": sum(sizes)}

    def close(self) -> None:
        self.client.close()
