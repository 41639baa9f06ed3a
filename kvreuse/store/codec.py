"""Entry <-> bytes, as a standard safetensors file laid out for partial reads.

Tensors: `k.{layer}` and `v.{layer}`, each [num_tokens, num_kv_heads, head_dim], plus optional `ranking` and
`boundary`. A layer range is then a set of whole tensors, and a token subset a set of byte runs inside them.
Checksums (XXH3-64) cover every `row_group` consecutive token rows of every K/V tensor, so a partial read
verifies exactly what it read; the metadata carries its own checksum, so a flipped byte anywhere is caught.
An entry with CacheTune's ranking keeps its rows in rank order, least important first (`row_order`): the rows
CacheTune loads (all but its top r) are then one run at the front of each tensor, so a sparse read reads
about the share of the bytes it keeps, not every row group; reads hand rows back in token order.
XXH3, not BLAKE3 as for keys: a checksum guards against damage, not an adversary, and XXH3 checks 12 GB/s on
this machine against BLAKE3's 2.7, which had made checksums 40% of a warm disk read.
Optional int8 form (lossy, opt-in per tier): `k.{layer}` holds int8 values and `k.{layer}.scale` one float32
scale per token and head (symmetric, absmax / 127), so the int8 tensors keep the token axis and partial reads
work unchanged; the entry reads back dequantized to its dtype, and its metadata says `quantized="int8"`.
The reader parses the safetensors header itself and asks a `ByteSource` only for the byte ranges it needs,
which is how disk (pread) and Redis (GETRANGE) serve partial reads without reading the whole entry. K/V bytes
land straight in the tensor a read returns (`read_into`: a file's preadv, Redis's pieces copied once) and are
checked there; the KV placer's reads of a mapped file take views of its pages instead (`mapped_view`), which the
layer order of `encode`'s files makes one strided view per read.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Annotated, Hashable, Literal, Sequence

import numpy as np
import pydantic
import torch
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from kvreuse.store.entry import (DTYPES, EntryMeta, KVEntry, check_layers, check_rows, consecutive,
                                 take_rows)

FORMAT = "kvreuse-kv/2"  # /2 adds `row_order`; /1 entries (token order) still read
READABLE_FORMATS = ("kvreuse-kv/1", FORMAT)
# Small enough that the run of rows a sparse read keeps wastes little of a group at its end (CacheTune's 85% of
# a 160-token chunk: 144 of 160 rows read, where 64-row groups read all 160); large enough that the checksums
# stay a small part of the header (about 20 bytes per group per layer).
DEFAULT_ROW_GROUP = 16
MAX_HEADER_BYTES = 64 << 20
# Row plans an entry's parsed header keeps (EntryReader._planned_rows)
ROW_PLANS_KEPT = 8
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8}
ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
INT8 = "int8"
Range = tuple[int, int]  # (offset, length)
Buffer = memoryview | np.ndarray  # writable bytes a read lands in


class EntryDamaged(Exception):
    """The stored bytes are not a valid entry for the key asked for: the caller treats it as a miss."""


class ByteSource(ABC):
    """Random access to one stored entry's bytes. Subclasses fetch byte spans; this class merges the spans
    a read asks for when they touch (all K tensors of a whole-entry read lie end to end), so the backend
    sees a few large requests rather than one per tensor, and checks that nothing came back short."""

    size: int
    fetched: int = 0  # bytes asked of the backend so far: what a read really cost, headers included
    # What changes whenever the stored bytes do (a file's inode and times, a Redis entry's version), so that a
    # parsed header can be reused for the same bytes; None: not known, parse every time.
    identity: Hashable | None = None

    @abstractmethod
    def _fetch(self, spans: list[Range]) -> list[bytes | memoryview]: ...

    def read_ranges(self, ranges: Sequence[Range]) -> list[memoryview]:
        """The bytes of each range; EntryDamaged if any lies past the end or comes back short."""
        spans, where = self._spans(ranges)
        fetched = [memoryview(data) for data in self._fetch(spans)]
        for span, data in zip(spans, fetched, strict=True):
            check_length(span, len(data))
        return [fetched[i][start : start + n] for (i, start), (_, n) in zip(where, ranges, strict=True)]

    def read_into(self, ranges: Sequence[Range], buffers: Sequence[Buffer]) -> None:
        """Each range's bytes written into its buffer (a writable buffer as long as the range), so that a
        backend which reads into memory (a file's preadv) moves each byte once; the ranges must not overlap.
        EntryDamaged as for `read_ranges`."""
        spans, where = self._spans(ranges)
        parts: list[list[tuple[int, Buffer]]] = [[] for _ in spans]
        for (i, start), buffer, (_, n) in zip(where, buffers, ranges, strict=True):
            if len(buffer) != n:
                raise ValueError(f"a buffer of {len(buffer)} bytes for a range of {n}")
            parts[i].append((start, buffer))
        for (_, n), span_parts in zip(spans, parts, strict=True):
            span_parts.sort(key=lambda part: part[0])
            if sum(len(buffer) for _, buffer in span_parts) != n:
                raise ValueError("overlapping ranges cannot be read into buffers")
        self._fetch_into(spans, [[buffer for _, buffer in span_parts] for span_parts in parts])

    def mapped_view(self, ranges: Sequence[Range]) -> memoryview | None:
        """The bytes from the first range's start to the last one's end, without a copy, for a backend whose
        entry is mapped into memory (None from the others); counted as fetched for the ranges alone (the bytes
        between them are not touched). The ranges must be in order. EntryDamaged as for `read_ranges`."""
        mapping = self._mapping()
        if mapping is None:
            return None
        self._spans(ranges)
        return memoryview(mapping)[ranges[0][0] : ranges[-1][0] + ranges[-1][1]]

    def _mapping(self) -> Buffer | None:
        return None

    def _spans(self, ranges: Sequence[Range]) -> tuple[list[Range], list[tuple[int, int]]]:
        if any(off + n > self.size for off, n in ranges):
            raise EntryDamaged(f"read past the end of a {self.size}-byte entry (truncated?)")
        spans, where = _merge(ranges)
        self.fetched += sum(n for _, n in spans)
        return spans, where

    def _fetch_into(self, spans: list[Range], buffers: list[list[Buffer]]) -> None:
        """Each span's bytes into its buffers, end to end; by default fetched, then copied."""
        for span, data, span_buffers in zip(spans, self._fetch(spans), buffers, strict=True):
            scatter(span, [data], span_buffers)


def scatter(span: Range, pieces: Sequence[bytes | memoryview], buffers: Sequence[Buffer]) -> None:
    """A span's bytes, fetched as `pieces` end to end, copied into `buffers` end to end (the same length in all,
    else the span came back short)."""
    check_length(span, sum(len(piece) for piece in pieces))
    sources = (np.frombuffer(piece, dtype=np.uint8) for piece in pieces if len(piece))
    source, at = next(sources, None), 0
    for buffer in buffers:
        target, filled = np.frombuffer(buffer, dtype=np.uint8), 0
        while filled < len(target):
            n = min(len(target) - filled, len(source) - at)
            target[filled : filled + n] = source[at : at + n]
            filled, at = filled + n, at + n
            if at == len(source):
                source, at = next(sources, None), 0


def check_length(span: Range, got: int) -> None:
    """EntryDamaged unless a span came back whole (`got` bytes of it)."""
    off, n = span
    if got != n:
        raise EntryDamaged(f"short read at {off}: {got} of {n} bytes (truncated or missing part?)")


def _merge(ranges: Sequence[Range]) -> tuple[list[Range], list[tuple[int, int]]]:
    """Touching or overlapping ranges merged into spans, and for each range: (its span, its offset in it)."""
    spans: list[list[int]] = []  # [offset, end]
    where: list[tuple[int, int]] = [(0, 0)] * len(ranges)
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        off, n = ranges[i]
        if spans and off <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], off + n)
        else:
            spans.append([off, off + n])
        where[i] = (len(spans) - 1, off - spans[-1][0])
    return [(a, b - a) for a, b in spans], where


class BufferSource(ByteSource):
    def __init__(self, data: bytes | bytearray | memoryview):
        self.data = memoryview(data)
        self.size = len(self.data)

    def _fetch(self, spans: list[Range]) -> list[memoryview]:
        return [self.data[off : off + n] for off, n in spans]


def _checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _raw_bytes(t: torch.Tensor) -> memoryview:
    # View as bytes first: numpy has no bfloat16.
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _group_checksums(data: memoryview, group_bytes: int) -> list[str]:
    return [_checksum(data[i : i + group_bytes]) for i in range(0, max(len(data), 1), group_bytes)]


# The int8 arithmetic runs in numpy: it shares the cores with the model's compute, and torch's parallel
# elementwise ops then wait for a free core (a 1-layer int8 read took 48 ms under load, against ~0.3 ms).
def _to_f32(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are the top half of a float32's
        return (t.contiguous().view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return t.numpy().astype(np.float32)


def _from_f32(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:  # round to nearest even on the bits, as torch's float -> bfloat16 does
        u = a.view(np.uint32)
        bits = u >> 16  # in place from here on: a temporary per step made this 3x slower
        bits &= 1
        bits += 0x7FFF
        bits += u
        bits >>= 16
        return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a.astype({torch.float32: np.float32, torch.float16: np.float16}[dtype]))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> int8 values and one float32 scale per leading index (symmetric absmax)."""
    a = _to_f32(x)
    if not np.isfinite(a).all():  # an infinite row's scale is too: the whole row would read back as NaN
        raise ValueError("int8 form: the entry holds values that are not finite")
    scale = np.abs(a).max(axis=-1) / 127
    scale[scale == 0] = 1  # an all-zero row must not divide by zero
    a = a / scale[..., None]
    np.rint(a, out=a)
    return torch.from_numpy(a.astype(np.int8)), torch.from_numpy(scale)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a = q.numpy().astype(np.float32)
    a *= scale.numpy()[..., None]
    return _from_f32(a, dtype)


def encode(entry: KVEntry, row_group: int = DEFAULT_ROW_GROUP, *, quantize: bool = False) -> bytes:
    m = entry.meta
    tensors: dict[str, torch.Tensor] = {}
    order = None if m.ranking is None else m.ranking.float().argsort(stable=True)  # least important first
    for kv, t in (("k", entry.k), ("v", entry.v)):
        t = t if order is None else t[:, order]
        for layer in range(m.num_layers):
            if quantize:
                tensors[f"{kv}.{layer}"], tensors[f"{kv}.{layer}.scale"] = quantize_int8(t[layer])
            else:
                tensors[f"{kv}.{layer}"] = t[layer].contiguous()
    if m.ranking is not None:
        tensors["ranking"] = m.ranking.contiguous()
    if m.boundary is not None:
        tensors["boundary"] = m.boundary.contiguous()
    checksums = {}
    for name, t in tensors.items():
        data = _raw_bytes(t)
        # K/V (and their scales) are checked per row group, for partial reads; extras are always read whole.
        per_token = name[:2] in ("k.", "v.")
        checksums[name] = _group_checksums(data, len(data) // len(t) * row_group if per_token else len(data))
    info = {
        "storage": INT8 if quantize else m.dtype,
        "quantized": INT8 if quantize else m.quantized,
        "key": entry.key,
        "model_fingerprint": m.model_fingerprint,
        "dtype": m.dtype,
        "num_layers": m.num_layers,
        "num_tokens": m.num_tokens,
        "num_kv_heads": entry.k.shape[2],
        "head_dim": entry.k.shape[3],
        "compile_mode": m.compile_mode,
        "boundary_layers": list(m.boundary_layers),
        "row_group": row_group,
        "row_order": None if order is None else order.tolist(),
        "checksums": checksums,
    }
    text = json.dumps(info, sort_keys=True)
    metadata = {"format": FORMAT, "entry": text, "entry_checksum": _checksum(text.encode())}
    return _safetensors_bytes(tensors, metadata)


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file of `tensors` whose data lie in the order given, widest dtype first (which keeps every
    tensor aligned). safetensors' own writer orders them by name, k.10 between k.1 and k.2; in layer order, the
    layers a read takes lie equally spaced, so a mapped file hands them out as one strided view (`mapped_view`)."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())  # stable: layer order kept
    header: dict[str, object] = {"__metadata__": metadata}
    end = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [end, end + t.numel() * t.element_size()]}
        end += t.numel() * t.element_size()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data start 8-byte aligned, as safetensors pads its header
    return b"".join([struct.pack("<Q", len(text)), text, *(_raw_bytes(tensors[name]) for name in order)])


Count = Annotated[int, Field(ge=1)]
Index = Annotated[int, Field(ge=0)]


class EntryInfo(BaseModel):
    """An entry's metadata (`encode`'s `info`), typed: one that passes its checksum yet lacks a field or holds one of
    the wrong type or range (another writer's bug, a hand-made file) is damage here, not a crash in a later read."""

    model_config = ConfigDict(strict=True, frozen=True)

    key: str
    model_fingerprint: str
    dtype: Literal[tuple(DTYPES)]  # the names the store keeps (kvreuse.store.entry.DTYPES)
    storage: Literal[(*DTYPES, INT8)]
    quantized: Literal["int8"] | None
    num_layers: Count
    num_tokens: Count
    num_kv_heads: Count
    head_dim: Count
    compile_mode: str
    boundary_layers: list[Index]
    row_group: Count
    row_order: list[int] | None = None  # format /1 entries have none: rows in token order
    checksums: dict[str, list[str]]  # XXH3-64 in hex, per row group of a K/V tensor, one for an extra


class _TensorHeader(BaseModel):
    """One tensor's line of the safetensors header."""

    model_config = ConfigDict(strict=True, frozen=True)

    dtype: Literal[tuple(ST_DTYPES)]
    shape: list[Index]
    data_offsets: Annotated[list[Index], Field(min_length=2, max_length=2)]


_TENSOR_TABLE = pydantic.TypeAdapter(dict[str, _TensorHeader])


@dataclass(frozen=True)
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the entry's bytes
    nbytes: int


class EntryReader:
    """Validated view of one stored entry; reads only the byte ranges a request needs."""

    def __init__(self, source: ByteSource, key: str):
        self.source = source
        try:
            self._parse_header(key)
        except EntryDamaged:
            raise
        # A malformed header is damage (pydantic's ValidationError is a ValueError; JSON nested past Python's
        # recursion limit, as another file's bytes can be, raises RecursionError).
        except (ValueError, KeyError, TypeError, AttributeError, struct.error, RecursionError) as e:
            raise EntryDamaged(f"malformed header: {e}") from e

    def _parse_header(self, key: str) -> None:
        (n,) = struct.unpack("<Q", bytes(self.source.read_ranges([(0, 8)])[0]))
        if n > MAX_HEADER_BYTES or 8 + n > self.source.size:
            raise EntryDamaged(f"header length {n} does not fit an entry of {self.source.size} bytes")
        header = json.loads(bytes(self.source.read_ranges([(8, n)])[0]))
        meta = header.pop("__metadata__")
        if meta.get("format") not in READABLE_FORMATS:
            raise EntryDamaged(f"not a {FORMAT} entry")
        if _checksum(meta["entry"].encode()) != meta["entry_checksum"]:
            raise EntryDamaged("metadata checksum mismatch")
        info = EntryInfo.model_validate_json(meta["entry"])
        if info.key != key:
            raise EntryDamaged(f"entry holds key {info.key!r}, not {key!r}")
        self.info = info
        self.tensors = {
            name: _TensorInfo(ST_DTYPES[t.dtype], tuple(t.shape), 8 + n + t.data_offsets[0],
                              t.data_offsets[1] - t.data_offsets[0])
            for name, t in _TENSOR_TABLE.validate_python(header).items()
        }
        self._validate_layout()
        # original row -> stored row; None: stored in token order
        order = info.row_order
        self._position = None
        if order is not None:
            order = np.asarray(order, dtype=np.int64)
            if order.shape != (info.num_tokens,) or not np.array_equal(np.sort(order), np.arange(len(order))):
                raise EntryDamaged("row_order is not a permutation of the entry's rows")
            self._position = np.argsort(order)
        # rows asked for -> their plan: a plan reads the same rows of an entry every few layers, and the copies of
        # this reader a header cache hands out share it
        self._row_plans: dict[bytes | None, _RowPlan] = {}

    def rebound(self, source: ByteSource | None) -> EntryReader:
        """This parsed header over another open source of the same bytes (None: detached, for a cache)."""
        reader = copy.copy(self)
        reader.source = source
        return reader

    @property
    def quantized(self) -> bool:
        return self.info.storage == INT8

    def _validate_layout(self) -> None:
        i = self.info
        T, H, D = i.num_tokens, i.num_kv_heads, i.head_dim
        stored = torch.int8 if self.quantized else DTYPES[i.dtype]
        expected = {f"{kv}.{layer}": (stored, (T, H, D)) for kv in "kv" for layer in range(i.num_layers)}
        if self.quantized:
            expected |= {f"{name}.scale": (torch.float32, (T, H)) for name in list(expected)}
        if not expected.keys() <= self.tensors.keys() or set(i.checksums) != self.tensors.keys():
            raise EntryDamaged("tensor list does not match the metadata")
        # Metadata under a valid checksum can still be wrong (another writer's bug, a hand-made file): what the
        # reads divide by and index into is checked here, so that it is damage, not a crash.
        for name, sums in i.checksums.items():
            groups = max(-(-T // i.row_group), 1) if name[:2] in ("k.", "v.") else 1
            if len(sums) != groups:
                raise EntryDamaged(f"{name} has {len(sums)} checksums, not {groups}")
        for name, t in self.tensors.items():
            nbytes = math.prod(t.shape) * t.dtype.itemsize
            if t.nbytes != nbytes or t.start + nbytes > self.source.size:
                raise EntryDamaged(f"tensor {name} has a bad extent (truncated entry?)")
            if name in expected and (t.dtype, t.shape) != expected[name]:
                raise EntryDamaged(f"tensor {name} is {t.dtype}{list(t.shape)}, not {expected[name]}")
        self._validate_extras()

    def _validate_extras(self) -> None:
        """`ranking` [num_tokens] and `boundary` [stages, num_tokens, hidden], of a KV dtype, where present: what
        `KVEntry` accepts, and what a method indexes by token."""
        i, kv_dtypes = self.info, set(DTYPES.values())
        ranking, boundary = self.tensors.get("ranking"), self.tensors.get("boundary")
        if ranking is not None and (ranking.dtype not in kv_dtypes or ranking.shape != (i.num_tokens,)):
            raise EntryDamaged(f"ranking is {ranking.dtype}{list(ranking.shape)}, not [{i.num_tokens}] of a KV dtype")
        if boundary is not None and (boundary.dtype not in kv_dtypes or len(boundary.shape) != 3
                                     or boundary.shape[:2] != (len(i.boundary_layers), i.num_tokens)):
            raise EntryDamaged(f"boundary is {boundary.dtype}{list(boundary.shape)}, not "
                               f"[{len(i.boundary_layers)}, {i.num_tokens}, hidden] of a KV dtype")

    def meta(self, with_extras: bool = True) -> EntryMeta:
        i = self.info
        extras = {name: self._read_whole(name) if with_extras and name in self.tensors else None
                  for name in ("ranking", "boundary")}
        return EntryMeta(i.model_fingerprint, i.dtype, i.num_layers, i.num_tokens, i.compile_mode,
                         extras["ranking"], extras["boundary"], list(i.boundary_layers), i.quantized)

    def _read_whole(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        (data,) = self.source.read_ranges([(t.start, t.nbytes)])
        if _checksum(data) != self.info.checksums[name][0]:
            raise EntryDamaged(f"checksum mismatch in {name}")
        out = torch.empty(t.shape, dtype=t.dtype)
        _as_bytes(out)[:] = np.frombuffer(data, dtype=np.uint8)
        return out

    def read(self, layers: range | None = None, rows: Sequence[int] | torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V for `layers` (default all) and token `rows` (default all, in the order given)."""
        k, v, picks = self.read_picking(layers, rows)
        return (k, v) if picks is None else (take_rows(k, picks), take_rows(v, picks))

    def read_picking(self, layers: range | None = None, rows: Sequence[int] | torch.Tensor | None = None,
                     *, mapped: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`read` for a caller that picks rows itself as it copies them (the KV placer): K and V of the row groups
        that hold `rows`, with the rows' indices among them to pick; the rows themselves where they run
        consecutively in the groups (a view, no copy), and no picks then. `mapped`: views of the entry's bytes
        where its source maps them and the groups are one run (`_mapped_rows`), for a caller that only reads
        them."""
        i = self.info
        layers = check_layers(layers, i.num_layers)
        plan = self._planned_rows(None if rows is None else check_rows(rows, i.num_tokens))
        k, v = self._read_kv("k", layers, plan, mapped), self._read_kv("v", layers, plan, mapped)
        if plan.run is not None:
            return k[:, plan.run], v[:, plan.run], None
        return k, v, plan.local

    def _planned_rows(self, rows: torch.Tensor | None) -> _RowPlan:
        """`_plan_rows`, kept for the next read of the same rows (a few: one per span reading the entry)."""
        key = None if rows is None else rows.numpy().tobytes()
        plan = self._row_plans.get(key)
        if plan is None:
            if len(self._row_plans) >= ROW_PLANS_KEPT:
                self._row_plans.clear()
            plan = self._row_plans[key] = self._plan_rows(rows)
        return plan

    def _plan_rows(self, rows: torch.Tensor | None) -> _RowPlan:
        g, T = self.info.row_group, self.info.num_tokens
        num_groups = -(-T // g)
        if rows is None:
            return _RowPlan([(0, num_groups)], T, None if self._position is None else torch.from_numpy(self._position))
        # numpy, not torch: small torch ops wait for a free core on a busy machine (6 ms for a searchsorted).
        r = rows.numpy() if self._position is None else self._position[rows.numpy()]
        group_of = r // g
        runs = _contiguous_runs(np.unique(group_of).tolist())
        start_of = np.zeros(num_groups, dtype=np.int64)  # where each loaded group starts among loaded rows
        loaded = 0
        for a, b in runs:
            for gi in range(a, b):
                start_of[gi] = loaded
                loaded += min((gi + 1) * g, T) - gi * g
        local = start_of[group_of] + r % g
        if len(local) == loaded and np.array_equal(local, np.arange(loaded)):  # whole groups, in order: no pick
            return _RowPlan(runs, loaded, None)
        return _RowPlan(runs, loaded, torch.from_numpy(local))

    def _read_kv(self, kv: str, layers: range, plan: _RowPlan, mapped: bool) -> torch.Tensor:
        if not self.quantized:
            viewed = self._mapped_rows(kv, layers, plan) if mapped else None
            return self._read_rows(kv, "", layers, plan) if viewed is None else viewed
        values = self._read_rows(kv, "", layers, plan)
        return dequantize_int8(values, self._read_rows(kv, ".scale", layers, plan), DTYPES[self.info.dtype])

    def _mapped_rows(self, kv: str, layers: range, plan: _RowPlan) -> torch.Tensor | None:
        """The row groups `plan` loads of tensors `{kv}.{layer}`, verified, as one strided view [len(layers), loaded
        rows, ...] of the mapped entry; None where the source maps nothing, the groups are several runs, or the
        layers do not lie equally spaced (entries written by safetensors' own writer, in name order), or there are
        none."""
        if len(plan.runs) != 1 or not layers:
            return None
        ((a, b),) = plan.runs
        g, T = self.info.row_group, self.info.num_tokens
        like = self.tensors[f"{kv}.0"]
        size, row_bytes = like.dtype.itemsize, math.prod(like.shape[1:]) * like.dtype.itemsize
        names = [f"{kv}.{layer}" for layer in layers]
        starts = [self.tensors[name].start + a * g * row_bytes for name in names]
        n = (min(b * g, T) - a * g) * row_bytes
        step = starts[1] - starts[0] if len(starts) > 1 else n
        if step < n or starts[0] % size or step % size or starts != list(range(starts[0], starts[-1] + 1, step)):
            return None
        view = self.source.mapped_view([(start, n) for start in starts])
        if view is None:
            return None
        for li, name in enumerate(names):  # checked in place: the caller reads them after this
            self._check_run(name, view[li * step : li * step + n], (a, b), row_bytes)
        shape = (plan.loaded, *like.shape[1:])
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # each layer's rows contiguous
        return torch.frombuffer(view, dtype=like.dtype).as_strided((len(names), *shape), (step // size, *strides))

    def _read_rows(self, kv: str, suffix: str, layers: range, plan: _RowPlan) -> torch.Tensor:
        """The row groups `plan` loads of tensors `{kv}.{layer}{suffix}`, verified, as [len(layers), loaded rows,
        ...]."""
        g, T = self.info.row_group, self.info.num_tokens
        like = self.tensors[f"{kv}.0{suffix}"]  # every layer's tensor has this dtype and shape
        row_bytes = math.prod(like.shape[1:]) * like.dtype.itemsize
        names = [f"{kv}.{layer}{suffix}" for layer in layers]
        ranges = [(self.tensors[name].start + a * g * row_bytes, (min(b * g, T) - a * g) * row_bytes)
                  for name in names for a, b in plan.runs]
        out = torch.empty((len(names), plan.loaded, *like.shape[1:]), dtype=like.dtype)
        out_bytes = _as_bytes(out).reshape(len(names), plan.loaded * row_bytes)
        buffers = []  # where each range lands: its layer's row of `out`, the runs end to end
        for li in range(len(names)):
            pos = 0
            for _, n in ranges[li * len(plan.runs) : (li + 1) * len(plan.runs)]:
                buffers.append(out_bytes[li, pos : pos + n])
                pos += n
        self.source.read_into(ranges, buffers)
        data = iter(buffers)
        for name in names:  # checked where they landed: nothing reads them before this
            for run in plan.runs:
                self._check_run(name, next(data), run, row_bytes)
        return out

    def _check_run(self, name: str, data: Buffer, groups: Range, row_bytes: int) -> None:
        """EntryDamaged unless the row groups [a, b) of tensor `name`, which `data` holds end to end, match their
        checksums."""
        (a, b), group_bytes = groups, self.info.row_group * row_bytes
        sums = self.info.checksums[name]
        for gi in range(a, b):
            if _checksum(data[(gi - a) * group_bytes : (gi - a + 1) * group_bytes]) != sums[gi]:
                raise EntryDamaged(f"checksum mismatch in {name} rows {gi * self.info.row_group}..")


@dataclass(frozen=True)
class _RowPlan:
    """The row groups a read loads, as half-open runs of group indices, and where requested rows land."""

    runs: list[Range]
    loaded: int  # rows the runs hold
    local: torch.Tensor | None  # index of each requested row among the loaded ones; None: all rows, in order

    @functools.cached_property
    def run(self) -> slice | None:
        """The requested rows as one run of the loaded ones (handed out as a view, nothing to pick), else None:
        worked out once for a plan that `EntryReader` keeps."""
        return None if self.local is None else consecutive(self.local)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous tensor's storage."""
    return t.view(-1).view(torch.uint8).numpy()


def _contiguous_runs(groups: list[int]) -> list[Range]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 7)]: half-open runs of consecutive group indices."""
    runs: list[list[int]] = []
    for gi in groups:
        if runs and runs[-1][1] == gi:
            runs[-1][1] = gi + 1
        else:
            runs.append([gi, gi + 1])
    return [(a, b) for a, b in runs]


def decode(source: ByteSource, key: str) -> KVEntry:
    reader = EntryReader(source, key)
    k, v = reader.read()
    return KVEntry(key, k, v, reader.meta())
