"""A request's own KV cache: per-layer keys (after RoPE) and values, plus each row's global position.

Rows are slots, not positions: fusion fills a prompt's rows out of order (stored rows, recomputed rows) and
decoding appends. Positions travel with the rows so attention can build an exact causal mask whatever the order.
A cache may live in a slot of a `KVPool` (sequences decoding together); its tensors are then views of the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvreuse.model.kv_pool import KVPool


class KVCache:
    pool: KVPool | None = None  # set by KVPool.adopt, with the cache's slot in it
    slot: int = -1

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity: int = 256,
        device: torch.device | str = "cpu",
    ):
        self.num_layers = num_layers
        self.length = 0
        self._shape = (num_kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.keys = [self._empty(capacity) for _ in range(num_layers)]
        self.values = [self._empty(capacity) for _ in range(num_layers)]
        self._positions = torch.empty(capacity, dtype=torch.long, device=device)

    def _empty(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, *self._shape), dtype=self._dtype, device=self._device)

    @property
    def form(self) -> tuple[torch.dtype, tuple[int, ...]]:
        """What one row of a layer's keys or values is: its dtype and shape (heads, head_dim)."""
        return self._dtype, self._shape

    @property
    def capacity(self) -> int:
        return self._positions.shape[0]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[: self.length]

    @property
    def next_position(self) -> int:
        """Where a token appended now sits: right after the furthest position held (0 when empty)."""
        return int(self.positions.max()) + 1 if self.length else 0

    def allocate(self, positions: torch.Tensor) -> slice:
        """Reserve rows for tokens at `positions`; the caller then writes every layer's K/V into them."""
        end = self.length + positions.shape[0]
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        rows = slice(self.length, end)
        self._positions[rows] = positions
        self.length = end
        return rows

    def _grow(self, capacity: int) -> None:
        if self.pool is not None:  # every slot of the pool grows, and the pool rebinds this cache's views
            self.pool.grow(capacity)
            return
        # every tensor made before any is assigned: an allocation that fails leaves the cache as it was
        keys = [self._grown(k, capacity) for k in self.keys]
        values = [self._grown(v, capacity) for v in self.values]
        positions = self._grown(self._positions, capacity)
        self.keys, self.values, self._positions = keys, values, positions

    def _grown(self, old: torch.Tensor, capacity: int) -> torch.Tensor:
        new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
        new[: self.length] = old[: self.length]
        return new

    def clone(self) -> KVCache:
        """An independent copy, outside any pool: two continuations of one prefill (a generation and a
        teacher-forced answer). Laid out as a cache of its own (rows of contiguous heads, as the native kernels read
        them), whatever a pool's slot held."""
        copy = KVCache.__new__(KVCache)
        copy.num_layers, copy.length, copy._shape = self.num_layers, self.length, self._shape
        copy._dtype, copy._device = self._dtype, self._device
        copy.keys = [k.clone(memory_format=torch.contiguous_format) for k in self.keys]
        copy.values = [v.clone(memory_format=torch.contiguous_format) for v in self.values]
        copy._positions = self._positions.clone()
        return copy

    def write(self, layer: int, rows: slice | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[layer][rows] = keys
        self.values[layer][rows] = values

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][: self.length], self.values[layer][: self.length]
