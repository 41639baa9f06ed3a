"""One stored KV cache: a chunk or a prefix block, with the metadata needed to trust and place it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvreuse.store.keys import check_key

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; the store keeps {', '.join(DTYPES)}")


# The store copies tensors through numpy: torch's parallel copy waits for a free core, which on a busy 2-core
# machine cost 8 ms for a 1.2 MB clone against 0.2 ms for numpy's single-threaded memcpy.
def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype)
    np.copyto(out.view(torch.uint8).numpy(), t.contiguous().view(torch.uint8).numpy())
    return out


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of t[:, rows] (rows along dim 1)."""
    if len(rows) == 0:  # numpy gives empty results zero strides, which torch cannot view as another dtype
        return torch.empty((t.shape[0], 0, *t.shape[2:]), dtype=t.dtype)
    # np.take with out= runs 10x slower than letting it allocate.
    return torch.from_numpy(np.take(t.contiguous().view(torch.uint8).numpy(), rows.numpy(), axis=1)).view(t.dtype)


def consecutive(rows: torch.Tensor) -> slice | None:
    """Rows that run up one at a time, as a slice; None for any other order, a gap or a repeat (and no rows)."""
    n = rows.numel()
    if not n or int(rows[-1]) - int(rows[0]) != n - 1 or (n > 1 and not bool((rows.diff() == 1).all())):
        return None
    return slice(int(rows[0]), int(rows[0]) + n)


@dataclass
class EntryMeta:
    model_fingerprint: str
    dtype: str
    num_layers: int
    num_tokens: int
    compile_mode: str = "plain"
    ranking: torch.Tensor | None = None  # [num_tokens], CacheTune's per-token score
    boundary: torch.Tensor | None = None  # [num_stages, num_tokens, hidden], pipeline-stage inputs
    boundary_layers: list[int] = field(default_factory=list)
    quantized: str | None = None  # "int8" once the values went through the lossy 8-bit form


@dataclass
class KVEntry:
    """k and v: [num_layers, num_tokens, num_kv_heads, head_dim]; K is stored before RoPE."""

    key: str
    k: torch.Tensor
    v: torch.Tensor
    meta: EntryMeta

    def __post_init__(self) -> None:
        check_key(self.key)
        m = self.meta
        if m.num_layers < 1 or m.num_tokens < 1:
            raise ValueError(f"an entry holds at least one layer and one token, got {m.num_layers} x {m.num_tokens}")
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise ValueError(f"k and v must share a 4-d shape, got {tuple(self.k.shape)} and {tuple(self.v.shape)}")
        if tuple(self.k.shape[:2]) != (m.num_layers, m.num_tokens):
            raise ValueError(
                f"k has {tuple(self.k.shape[:2])} (layers, tokens) but meta says ({m.num_layers}, {m.num_tokens})"
            )
        if self.k.dtype != self.v.dtype or dtype_name(self.k.dtype) != m.dtype:
            raise ValueError(f"k/v dtypes {self.k.dtype}/{self.v.dtype} do not match meta dtype {m.dtype!r}")
        if m.ranking is not None and tuple(m.ranking.shape) != (m.num_tokens,):
            raise ValueError(f"ranking must have shape ({m.num_tokens},), got {tuple(m.ranking.shape)}")
        for extra in (m.ranking, m.boundary):
            if extra is not None:
                dtype_name(extra.dtype)  # the store keeps float32/bfloat16/float16 only
        if m.boundary is not None:
            if m.boundary.dim() != 3 or m.boundary.shape[:2] != (len(m.boundary_layers), m.num_tokens):
                raise ValueError(
                    f"boundary must be [{len(m.boundary_layers)} stages, {m.num_tokens} tokens, hidden], "
                    f"got {tuple(m.boundary.shape)}"
                )

    def clone(self) -> KVEntry:
        """A deep copy: the store keeps and hands out copies, so no caller's writes can change the cache."""
        m = self.meta
        extras = [None if t is None else copy_tensor(t) for t in (m.ranking, m.boundary)]
        meta = EntryMeta(m.model_fingerprint, m.dtype, m.num_layers, m.num_tokens, m.compile_mode, *extras,
                         list(m.boundary_layers), m.quantized)
        return KVEntry(self.key, copy_tensor(self.k), copy_tensor(self.v), meta)

    @property
    def nbytes(self) -> int:
        extras = [t for t in (self.meta.ranking, self.meta.boundary) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *extras))


def check_layers(layers: range | None, num_layers: int) -> range:
    """`layers` (default all) if it is a contiguous range inside the entry, else ValueError."""
    layers = range(num_layers) if layers is None else layers
    if layers.step != 1 or not 0 <= layers.start <= layers.stop <= num_layers:
        raise ValueError(f"layer range {layers} is not a contiguous range within 0..{num_layers}")
    return layers


def check_rows(rows: Sequence[int] | torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token rows as a 1-d long tensor, or ValueError if any lies outside the entry."""
    idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < num_tokens):
        raise ValueError(f"token rows must lie in 0..{num_tokens - 1}")
    return idx
