"""Local disk tier: one safetensors file per entry under a directory, written atomically.

Layout: ROOT/ab/abcdef....kv.safetensors (two-character fan-out keeps directories small). A write goes to a
unique temp file in the same directory, is fsynced, then renamed over the final name, and the directory is
fsynced: readers and concurrent writers of one key see one whole file, never a mix. Reads preadv only the
byte ranges they need, into the tensors they return; the KV placer's reads (`view_picking`) take views of the
file's pages instead, from the last files kept mapped (`FileMappings`), checked where they lie. Capacity is
enforced by a segmented LRU over the files this process knows (it scans the directory on open); several
processes may share a directory, each keeping its own budget.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Hashable, Iterator

from kvreuse.store.base import BlobTier
from kvreuse.store.codec import Buffer, ByteSource, EntryDamaged, Range, check_length
from kvreuse.store.keys import KEY_PATTERN, check_key
from kvreuse.store.policy import SegmentedLRU

log = logging.getLogger("kvreuse.store")
SUFFIX = ".kv.safetensors"
TMP_PREFIX = ".tmp-"
STALE_TMP_SECONDS = 3600  # a temp file this old belongs to a writer that died
IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one preadv takes
MAPPINGS_KEPT = 128  # entry files kept mapped: a few requests' chunks and prefix blocks


class FileMappings:
    """The last `kept` entry files mapped, by path: a read of a file mapped before finds its pages in place (a
    fresh mapping faulted each page in again, at every read of a few layers). A file replaced under its path
    (another inode, size or times) is mapped afresh; a view handed out keeps its mapping alive past eviction."""

    def __init__(self, kept: int = MAPPINGS_KEPT):
        self.kept = kept
        self._maps: collections.OrderedDict[str, tuple[Hashable, mmap.mmap]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str, source: FileSource) -> mmap.mmap | None:
        """The file mapped, or None where it cannot be (a file system without mmap, no address space left): its
        reads then copy."""
        with self._lock:
            kept = self._maps.get(path)
            if kept is not None and kept[0] == source.identity:
                self._maps.move_to_end(path)
                return kept[1]
        try:
            # Private and writable only so that torch takes views of it without a warning; nothing writes it.
            mapping = mmap.mmap(source.fd, source.size, access=mmap.ACCESS_COPY)
        except OSError as error:
            log.debug("%s: not mapped (%s); read by copies", path, error)
            return None
        with self._lock:
            self._maps[path] = (source.identity, mapping)
            self._maps.move_to_end(path)
            while len(self._maps) > self.kept:
                self._maps.popitem(last=False)
        return mapping

    def forget(self, path: str) -> None:
        with self._lock:
            self._maps.pop(path, None)


class FileSource(ByteSource):
    def __init__(self, fd: int, path: str, mappings: FileMappings):
        self.fd, self.path, self.mappings = fd, path, mappings
        st = os.fstat(fd)
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _fetch(self, spans: list[Range]) -> list[bytes]:
        return [os.pread(self.fd, n, off) for off, n in spans]

    def _mapping(self) -> mmap.mmap | None:
        # The file's pages themselves, handed out as views for the KV placer to copy from (one copy, as from the
        # memory tier, where preadv made two). Entry files are replaced by renames, never rewritten or truncated
        # in place, so what a view shows stays the bytes it was checked as.
        return self.mappings.get(self.path, self) if self.size else None

    def _fetch_into(self, spans: list[Range], buffers: list[list[Buffer]]) -> None:
        # Straight from the page cache into the caller's tensors: one copy of each byte, not two.
        for (off, n), span_buffers in zip(spans, buffers, strict=True):
            got = 0
            for start in range(0, len(span_buffers), IOV_MAX):
                batch = span_buffers[start : start + IOV_MAX]
                read = os.preadv(self.fd, batch, off + got)
                got += read
                if read != sum(len(buffer) for buffer in batch):
                    break
            check_length((off, n), got)


class DiskTier(BlobTier):
    # hotpotqa's 1.6K-token prompts, 10 chunks: 10 reads instead of 50 (6 layers a read), 4-7% less time
    reads_whole_spans = True

    def __init__(self, root: str | os.PathLike, capacity: int | None = None, *, protected_share: float = 0.8,
                 quantize: bool = False, create: bool = True, **expect: str | None):
        """create: make `root` if it does not exist (False: it must exist)."""
        super().__init__(f"disk:{root}", quantize=quantize, **expect)
        self.root = Path(root)
        if not create and not self.root.is_dir():
            raise FileNotFoundError(f"{self.root}: no such folder")
        self.root.mkdir(parents=True, exist_ok=True)
        self.policy = SegmentedLRU(capacity, protected_share)
        self.lock = threading.Lock()
        self._landing: set[str] = set()  # keys whose room is taken while their files are written
        self.mappings = FileMappings()
        self._scan()

    def path(self, key: str) -> Path:
        # check_key admits only [A-Za-z0-9_-], so a key can name no other directory.
        check_key(key)
        return self.root / key[:2] / (key + SUFFIX)

    def _scan(self) -> None:
        """Track existing entries oldest first (so LRU order survives restarts) and drop stale temp files.
        Nothing is evicted here, so that opening a store to look at it (`kvreuse cache ls`) never deletes: a
        directory over capacity is brought down to it by the next write."""
        files = []
        for path in self.root.glob("*/*"):
            try:
                st = path.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            if path.name.startswith(TMP_PREFIX):
                if time.time() - st.st_mtime > STALE_TMP_SECONDS:
                    self._unlink(path)
            elif path.name.endswith(SUFFIX) and KEY_PATTERN.fullmatch(path.name[: -len(SUFFIX)]):
                files.append((st.st_mtime, path.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(files):
            self.policy.adopt(key, size)

    def _unlink(self, path: Path) -> None:
        self.mappings.forget(str(path))  # a file kept mapped would keep its blocks on disk
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a read-only store can still be read
            log.warning("%s: could not remove %s: %s", self.name, path, e)

    def _evict(self, keys: list[str]) -> None:
        for key in keys:
            self._unlink(self.path(key))
        self.count("evictions", len(keys))

    @contextlib.contextmanager
    def _open(self, key: str) -> Iterator[FileSource | None]:
        try:
            # O_NONBLOCK: a FIFO planted at the path would otherwise block the open until someone writes to it.
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            self._vanished(key)
            yield None
            return
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink where an entry file should be: nothing we wrote
                raise EntryDamaged("a symbolic link in place of the entry file") from e
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory (or device) where the file should be
                raise EntryDamaged("not a regular file")
            yield FileSource(fd, str(self.path(key)), self.mappings)
        finally:
            os.close(fd)

    def _hit(self, key: str) -> None:
        with self.lock:
            self.policy.touch(key)

    def _exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path(key)).st_mode)  # a directory or link there is not an entry
        except FileNotFoundError:
            self._vanished(key)
            return False

    def _vanished(self, key: str) -> None:
        """An entry file removed by someone else (`kvreuse cache rm` or `clear` beside a server, the folder
        deleted) stops counting in the tier's usage and budget once it is found missing."""
        with self.lock:
            if key not in self._landing:  # its file is on its way: its room stays taken
                self.policy.remove(key)

    def _write(self, key: str, data: bytes) -> None:
        if not self.policy.fits(len(data)):
            raise OSError(errno.ENOSPC, f"{len(data)} bytes exceed the tier's capacity {self.policy.capacity}")
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)  # the root too, if it was deleted under us
        # Room is made before the file is written, so the folder never holds more than its capacity, not even
        # while a write lands (a capacity sized to a partition would otherwise fill it).
        with self.lock:
            evicted = self.policy.admit(key, len(data))
            self._landing.add(key)
        self._evict(evicted)
        tmp = final.parent / f"{TMP_PREFIX}{key}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            with self.lock:
                self._landing.discard(key)
            self._remove(key)  # what it replaced too: a key names its content, so it is a miss, not a loss
            raise
        with self.lock:
            self._landing.discard(key)
        _fsync_dir(final.parent)

    def _remove(self, key: str) -> bool:
        with self.lock:
            self.policy.remove(key)
        path = self.path(key)
        self.mappings.forget(str(path))
        try:
            path.unlink()
            return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:  # damage at our own entry path, inside our root: ours to remove
            shutil.rmtree(path)
            return True

    def keys(self) -> Iterator[str]:
        for path in sorted(self.root.glob(f"*/*{SUFFIX}")):
            key = path.name[: -len(SUFFIX)]
            if KEY_PATTERN.fullmatch(key):  # a stray file named like an entry is not one
                yield key

    def fits(self, nbytes: int) -> bool:
        return self.policy.fits(nbytes)

    def room_left(self) -> int | None:
        return self.policy.room_left()

    def usage(self) -> dict[str, int]:
        if not self.root.is_dir():  # deleted under us: none of the entries it held is left
            with self.lock:
                self.policy.forget_all()
        return {"entries": len(self.policy), "bytes_used": self.policy.used, "capacity": self.policy.capacity or 0}


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse to fsync a directory, which is harmless.
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
