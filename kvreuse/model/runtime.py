"""Layer-wise model runtime: one layer step and one loop over layers, driven by every path of the engine.

`step` runs a decoder layer for groups of rows (one group per request):

    qkv(all rows)  ->  rope(q, k at any global positions)  ->  per group: [narrow]  ->  write KV into its
    cache  ->  attend(its queries over its cache, causal by position)  ->  finish_layer(all rows)

`run_layers` is the only loop over layers; full prefill, batched decode, every fusion plan and every prefix
restoration are `LayerDriver`s of it, saying which rows enter each layer. `place` is the one way stored KV gets
into a request's cache. Keys come out of `qkv` before RoPE (the stored form), so a chunk computed at offset 0 can
be placed anywhere by rotating its keys to their new positions. The weights, norms, activations and rotary
module are the loaded `transformers` model's own; every projection's product goes through `linear.py`,
attention through `attention.py`, and `adapters.py` covers what differs between families. A step of one request's
rows, or of a pool's decoding rows, runs the same kernels with their arguments resolved once (`resolved_step.py`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from kvreuse.model import native
from kvreuse.model.adapters import adapter_for
from kvreuse.model.allocator import keep_freed_memory
from kvreuse.model.attention import attend, attention_mask
from kvreuse.model.kv_cache import KVCache
from kvreuse.model.kv_pool import KVPool, PooledStep
from kvreuse.model.linear import int8_panels, linear, linear_int8, pack_weights
from kvreuse.model.resolved_step import ResolvedStep


@dataclass
class Rotary:
    """cos/sin tables for a set of positions, shaped [kinds, n, 1, head_dim]: one table per kind of RoPE the
    model's layers use (one for most families; Gemma 3's sliding and full layers rotate by different bases),
    each broadcasting over heads."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __getitem__(self, rows: torch.Tensor | slice) -> Rotary:
        return Rotary(self.cos[:, rows], self.sin[:, rows])

    @staticmethod
    def cat(tables: Sequence[Rotary]) -> Rotary:
        return Rotary(torch.cat([t.cos for t in tables], 1), torch.cat([t.sin for t in tables], 1))


# (layer, q, k, v) of a group's rows, q and k rotated -> indices of the rows that go on (a narrowing plan)
Narrow = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer, hidden entering it, k before RoPE, v) of a group's rows: the stored form, for writing KV back
Capture = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


LAST_ROW = slice(-1, None)  # a group's `outputs` where only its last row's next token is wanted


@dataclass
class RowGroup:
    """One request's rows in a layer step: they fill `rows` of `cache` (slots, not positions) at `positions`
    and attend over the cache's first `keys_until` rows (default: every row it holds; a restoration stops at its
    run's end, as later rows may be unwritten memory, which a mask does not make safe)."""

    cache: KVCache
    rows: slice | torch.Tensor
    positions: torch.Tensor
    rotary: Rotary
    keys_until: int | None = None
    narrow: Narrow | None = None
    capture: Capture | None = None
    # Sees the group's rotated queries, its rows and its cache once the layer's KV is written (analyses).
    observe: Callable[[int, torch.Tensor, torch.Tensor, KVCache], None] | None = None
    # The rows (of those it keeps) whose output the step returns; the others end with their KV written. A prompt's
    # last layer: only its last row goes on to the LM head, so the others skip attention, o-projection and MLP.
    outputs: slice | None = None
    # A decoding step's row (`decode`, `decode_batch`): its products run over int8 weights where the model decodes
    # in int8 (`LayerwiseModel.decode_in_int8`); a prompt's rows, whose KV may be stored, never do.
    decoding: bool = False

    def __len__(self) -> int:
        return self.positions.numel()


@dataclass
class StepShape:
    """What a layer step derives from its groups alone: the same at every layer they enter."""

    groups: Sequence[RowGroup]
    parts: list[slice]  # where each group's rows sit in the step's joined rows
    rotary: Rotary  # the joined rows' RoPE tables
    captures: bool  # some group records its KV
    pooled: tuple[KVPool, PooledStep] | None  # decoding rows that attend in one call over their pool
    int8: bool = False  # decoding rows of a model that decodes in int8: products over int8 weights
    resolved: ResolvedStep | None = None  # the rows' layers as native calls resolved once


class LayerDriver(Protocol):
    """What `run_layers` asks at each layer: the rows that enter it, grouped by request, and what to do with
    their output."""

    def enter(self, layer: int) -> tuple[torch.Tensor, Sequence[RowGroup]]: ...

    def leave(self, layer: int, hidden: torch.Tensor) -> None: ...


@dataclass
class Straight:
    """The same rows through every layer (a prefill, a decoding step): each layer's output enters the next."""

    hidden: torch.Tensor
    groups: Sequence[RowGroup]
    last: tuple[int, Sequence[RowGroup]] | None = None  # a layer and the groups it gets instead (LAST_ROW's)

    def enter(self, layer: int) -> tuple[torch.Tensor, Sequence[RowGroup]]:
        if self.last is not None and layer == self.last[0]:
            return self.hidden, self.last[1]
        return self.hidden, self.groups

    def leave(self, layer: int, hidden: torch.Tensor) -> None:
        self.hidden = hidden


@dataclass
class CapturedKV:
    """The stored form of rows' KV (keys before RoPE), layer by layer: what a prefill writes back to the store."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def record(self, layer: int, hidden: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k and v are views of the layer's q/k/v product: copies keep only their own rows alive
        self.keys.append(k.contiguous())
        self.values.append(v.contiguous())

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_layers, n, num_kv_heads, head_dim] each."""
        return torch.stack(self.keys), torch.stack(self.values)


@dataclass
class PrefillResult:
    logits: torch.Tensor  # [vocab]: next-token logits after the last prompt token
    cache: KVCache
    # Stored form of the prompt's KV when asked for: [num_layers, n, num_kv_heads, head_dim], keys before RoPE.
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


class LayerwiseModel:
    def __init__(self, hf_model: nn.Module):
        self.hf_model = hf_model.eval()
        self.adapter = adapter_for(hf_model)
        self.config = hf_model.config
        self.decoder = hf_model.model
        self.layers = self.decoder.layers
        self.num_layers = len(self.layers)
        self.num_q_heads = self.config.num_attention_heads
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = self.layers[0].self_attn.head_dim
        self.hidden_size = self.config.hidden_size
        self.dtype = next(hf_model.parameters()).dtype
        self.device = next(hf_model.parameters()).device
        self.windows = [self.adapter.sliding_window(i) for i in range(self.num_layers)]
        self.rope_kinds = self.adapter.rope_kinds()  # the rotary module's argument per kind (None: takes none)
        # each layer's kind as an index into rope_kinds (and into a Rotary's tables)
        self.rope_kind_of_layer = [self.rope_kinds.index(self.adapter.rope_kind(i)) for i in range(self.num_layers)]
        # RoPE tables of positions [0, n), grown on demand: building them for a long prompt costs more than
        # loading its KV. Dynamic and longrope scaling make a position's angles depend on the whole call's
        # positions, so those rope types build tables per call.
        self._rotary_cacheable = _rotary_cacheable(self.decoder.rotary_emb)
        self._rotary_table: Rotary | None = None
        # The step under way, per thread: a batch restoration runs steps of different groups in several threads.
        self._step_under_way = threading.local()
        self._between_layers = threading.local()  # between_layers: per thread, as the engine thread alone pauses
        self.int8_decoding = False  # decode_in_int8
        pack_weights([group for block in self.layers for group in self.adapter.products(block)]
                     + [(hf_model.lm_head,)])
        native.available()  # builds the C kernels now (the first time on this CPU), not in the first request
        keep_freed_memory()  # requests reuse the memory earlier ones freed, not fresh pages

    # ---- primitives -------------------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(token_ids)

    def qkv(self, layer: int, hidden: torch.Tensor, int8: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden rows [n, hidden] entering `layer` -> q [n, Hq, D], k [n, Hkv, D] (before RoPE), v; `int8`: over
        the weights in int8 (a decoding step of a model that decodes in int8)."""
        return self.adapter.project_qkv(self.layers[layer], hidden, int8)

    def rotary(self, positions: torch.Tensor | range) -> Rotary:
        """RoPE tables for `positions`, from the model's own rotary module (its scaling included). For a range
        of positions the tables are views of the model's, not copies."""
        if not self._rotary_cacheable:
            return self._rotary_of(torch.as_tensor(positions, device=self.device))
        if isinstance(positions, range) and positions.step == 1:
            return self._rotary_rows(positions.stop)[positions.start : positions.stop]
        positions = torch.as_tensor(positions, device=self.device)
        return self._rotary_rows(int(positions.max()) + 1 if positions.numel() else 0)[positions]

    def _rotary_rows(self, needed: int) -> Rotary:
        """The table of positions [0, n) for some n >= needed."""
        table = self._rotary_table
        if table is None or table.cos.shape[1] < needed:
            # Doubling keeps a growing conversation from rebuilding the table every turn. Each angle is one
            # product of position and frequency, so a table row equals what a call for that position alone gives.
            rows = max(needed, 2 * table.cos.shape[1] if table is not None else 1024)
            table = self._rotary_table = self._rotary_of(torch.arange(rows, device=self.device))
        return table

    def _rotary_of(self, positions: torch.Tensor) -> Rotary:
        tables = [self.decoder.rotary_emb(self._probe, positions[None, :], *([] if kind is None else [kind]))
                  for kind in self.rope_kinds]
        return Rotary(torch.stack([cos[0, :, None, :] for cos, _ in tables]),
                      torch.stack([sin[0, :, None, :] for _, sin in tables]))

    @property
    def _probe(self) -> torch.Tensor:
        # The rotary module reads only dtype and device from its first argument.
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def rope(self, layer: int, x: torch.Tensor, rotary: Rotary, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate q or k rows [n, H, D] of `layer` to the positions `rotary` was built for, into `out` if given:
        keys go straight into their cache rows, with no temporaries to allocate and copy. The maths of
        transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: in one
        native pass where it runs, else a half at a time so that rotate_half(x) is never built (a copy and a
        negation of every row)."""
        cos, sin = self._rope_tables(layer, rotary)
        tensors = [t for t in (x, out) if t is not None]
        if native.runs_fp32_or_bf16(cos, *tensors) and all(native.heads_in_rows(t) for t in tensors):
            return native.rope(x, cos[:, 0], sin[:, 0], out)
        half = x.shape[-1] // 2
        out = torch.mul(x, cos, out=out)
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out

    def rope_qk(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rows of `layer` rotated (`rope`): in one pass when k's heads follow q's in the same rows, as the
        views of one product do (a call's fixed cost is a fair part of a decoding step's rotation)."""
        joined = _heads_side_by_side(q, k)
        if joined is None:
            return self.rope(layer, q, rotary), self.rope(layer, k, rotary)
        rotated = self.rope(layer, joined, rotary)
        return rotated[:, : q.shape[1]], rotated[:, q.shape[1] :]

    def _rope_tables(self, layer: int, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the kind of RoPE `layer` uses, [n, 1, head_dim] each."""
        kind = self.rope_kind_of_layer[layer]
        return rotary.cos[kind], rotary.sin[kind]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Rotated queries [n, Hq, D] of `layer` over rotated keys/values [m, Hkv, D], exact causal mask by
        position whatever the row order; returns [n, Hq * D]."""
        return attend(q, q_pos, keys, values, k_pos, self.windows[layer], self.layers[layer].self_attn.scaling)

    def attention_weights(
        self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor
    ) -> torch.Tensor:
        """The probabilities `attend` weights the values with, [Hq, n, m] in fp32: for analyses, which need the
        attention map itself (the fused kernel never materialises it)."""
        grouped = keys.repeat_interleave(self.num_q_heads // self.num_kv_heads, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q.float(), grouped.float()) * self.layers[layer].self_attn.scaling
        allowed = attention_mask(q_pos, k_pos, self.windows[layer])
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1)

    def place(self, cache: KVCache, layer: int, rows: slice | torch.Tensor,
              keys: torch.Tensor | Sequence[torch.Tensor], values: torch.Tensor | Sequence[torch.Tensor],
              rotary: Rotary, picks: Sequence[torch.Tensor | None] | None = None) -> None:
        """The one KV placer: stored-form KV (keys before RoPE, any device and dtype) moved to the model's
        device and dtype, keys rotated to the rows' positions, written at `rows` of `cache`. Keys and values come
        whole or in parts (a loaded layer's spans), whose rows in turn are `rows`; a part's rows are picks[p] of
        it where given (a tier's layer handed out whole). Parts in the model's dtype go into the cache in one
        native pass (each part converted first if it must be), never joined or gathered into a copy; a cache
        whose rows are not of contiguous heads (one in a pool's slot) takes torch's ops."""
        if isinstance(keys, torch.Tensor):
            keys, values = [keys], [values]
        self.place_layers(cache, range(layer, layer + 1), rows, [k.unsqueeze(0) for k in keys],
                          [v.unsqueeze(0) for v in values], rotary, picks)

    def place_layers(self, cache: KVCache, layers: range, rows: slice | torch.Tensor, keys: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], rotary: Rotary,
                     picks: Sequence[torch.Tensor | None] | None = None) -> None:
        """`place` for consecutive `layers` at once, each part's keys and values [len(layers), rows_p, heads, dim]:
        a read of several layers placed in one native pass instead of a call (and its checks) for each."""
        picks = [None] * len(keys) if picks is None else picks
        keys, values = ([t.to(device=self.device, dtype=self.dtype) for t in parts] for parts in (keys, values))
        tables = [self._rope_tables(layer, rotary) for layer in layers]
        cos, sin = ([table[i][:, 0] for table in tables] for i in (0, 1))
        cache_keys, cache_values = cache.keys[layers.start : layers.stop], cache.values[layers.start : layers.stop]
        if (native.runs_fp32_or_bf16(cos[0], *keys, *values, cache_keys[0])
                and all(t[0].is_contiguous() for t in (*keys, *values))
                and native.heads_in_rows(cache_keys[0]) and cache_keys[0].stride() == cache_values[0].stride()):
            native.place_layers(keys, values, cos, sin, rows, cache_keys, cache_values,
                                [p if p is None else p.to(device=self.device) for p in picks])
            return
        keys, values = ([t if p is None else t[:, p.to(t.device)] for t, p in zip(parts, picks)]
                        for parts in (keys, values))
        keys, values = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in (keys, values))
        for i, layer in enumerate(layers):
            if isinstance(rows, slice):  # rotated straight into the cache's memory: no temporary to copy
                self.rope(layer, keys[i], rotary, out=cache_keys[i][rows])
                cache_values[i][rows] = values[i]
            else:
                cache.write(layer, rows, self.rope(layer, keys[i], rotary), values[i])

    def outputs_at(self, layer: int) -> slice | None:
        """The rows of a prompt's group whose output `layer`'s step returns: past the model's last layer only the LM
        head reads a hidden state, and only the prompt's last row's (LAST_ROW); below it every row's (None)."""
        return LAST_ROW if layer == self.num_layers - 1 else None

    def finish_layer(self, layer: int, residual: torch.Tensor, attn_out: torch.Tensor, int8: bool = False
                     ) -> torch.Tensor:
        """Output projection, residual, post-attention norm and MLP for the rows that were attended."""
        return self.adapter.finish_layer(self.layers[layer], residual, attn_out, int8)

    def logits(self, hidden: torch.Tensor, int8: bool = False) -> torch.Tensor:
        """Final norm and LM head (over its weight in int8 if `int8`); callers pass only the rows whose next token
        they need."""
        normed, lm_head = self.adapter.norm(self.decoder.norm, hidden), self.hf_model.lm_head
        return self.adapter.cap_logits(linear_int8(normed.contiguous(), lm_head) if int8 else linear(normed, lm_head))

    def decode_in_int8(self, enabled: bool = True) -> None:
        """Decode from now on (or, not `enabled`, no longer) with every projection's and the LM head's weights in
        int8 (symmetric, one scale per output: `native.int8_panels`), multiplied by fp32 rows: a decoding step reads a
        quarter of fp32's bytes.
        Prompts, fusion plans and restorations keep the model's fp32 weights, so stored KV and first tokens are
        unchanged; only the tokens after the first move (docs/RESULTS.md, its fidelity rows). Every decoding step
        runs over int8 weights, whichever step runs it (the native layer calls of `ResolvedStep`, or the general
        step for a batch the pool cannot attend in slot order), so a sequence's tokens do not depend on its
        neighbours in a batch."""
        if not enabled:
            self.int8_decoding = False
            return
        if self.dtype != torch.float32 or self.device.type != "cpu" or not native.available():
            raise ValueError(f"int8 decoding takes an fp32 model on the CPU with kvreuse's native kernels; this one "
                             f"is {str(self.dtype).removeprefix('torch.')} on {self.device}"
                             + ("" if native.available() else ", without them (no C compiler, or KVREUSE_NATIVE=0)"))
        # packed now, not in the first decoding step
        if self.adapter.native_layers(1, self.dtype, int8=True) is None:
            raise ValueError(f"int8 decoding runs layers of the Llama family (Llama, SmolLM2, Mistral, Qwen2) in "
                             f"kvreuse's native calls; {type(self.hf_model).__name__}'s layers are not those")
        int8_panels(self.hf_model.lm_head)
        self.int8_decoding = True

    # ---- composites ------------------------------------------------------------------------------------

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, capacity, self.device)

    def step(self, layer: int, hidden: torch.Tensor, groups: Sequence[RowGroup]) -> torch.Tensor:
        """The one layer step. `hidden` holds the rows entering `layer` of every group, in group order.

        Projections, norms and MLP run on all rows at once (one weight read for every request of a batch, which
        is what makes batching pay); RoPE too. Per group: its KV written into its own cache, then attention of
        its queries over its cache's keys with the exact causal mask by position. Returns the rows' output, in
        the same order; a group that narrows keeps only the rows it chose, and one with `outputs` only those.
        One request's rows, or a pool's decoding rows, run the same kernels as calls resolved once (`ResolvedStep`).
        """
        shape = self._shape_of(groups)
        if shape.resolved is not None and shape.resolved.takes(hidden):
            return shape.resolved.run_layer(layer, hidden)
        q, k, v = self.qkv(layer, hidden, shape.int8)
        parts = shape.parts
        if shape.captures:
            for group, part in zip(groups, parts):
                if group.capture is not None:
                    group.capture(layer, hidden[part], k[part], v[part])
        q, k = self.rope_qk(layer, q, k, shape.rotary)
        if shape.pooled is not None:
            pool, pooled = shape.pooled
            scale = self.layers[layer].self_attn.scaling
            out = pool.attend_one_each(layer, pooled, q, k, v, self.windows[layer], scale)
            return self.finish_layer(layer, hidden, out, shape.int8)
        outputs, kept = [], []
        selecting = any(g.narrow is not None or g.outputs is not None for g in groups)
        for group, part in zip(groups, parts):
            gq, gk, gv, rows, positions = q[part], k[part], v[part], group.rows, group.positions
            keep = torch.arange(part.stop - part.start, device=self.device) if selecting else None
            if group.narrow is not None:
                keep = group.narrow(layer, gq, gk, gv)
                gq, gk, gv, rows, positions = gq[keep], gk[keep], gv[keep], rows[keep], positions[keep]
            group.cache.write(layer, rows, gk, gv)
            if group.observe is not None:
                group.observe(layer, gq, rows, group.cache)
            if group.outputs is not None:
                gq, positions, keep = gq[group.outputs], positions[group.outputs], keep[group.outputs]
            if selecting:
                kept.append(part.start + keep)
            end = group.cache.length if group.keys_until is None else group.keys_until
            keys, values = group.cache.keys[layer][:end], group.cache.values[layer][:end]
            outputs.append(self.attend(layer, gq, positions, keys, values, group.cache.positions[:end]))
        residual = hidden[torch.cat(kept)] if kept else hidden
        return self.finish_layer(layer, residual, outputs[0] if len(outputs) == 1 else torch.cat(outputs), shape.int8)

    def _shape_of(self, groups: Sequence[RowGroup]) -> StepShape:
        """What the step derives from its groups alone, built at the first layer that gets them: a driver that
        keeps its groups (a decoding step) hands every layer the same list, and one that changes them builds a
        new list."""
        shape = getattr(self._step_under_way, "shape", None)
        if shape is None or shape.groups is not groups:
            pool = _pool_decoding(groups)
            pooled = None
            if pool is not None:
                rows = torch.tensor([_single_row(g.rows) for g in groups], device=self.device)
                pooled = pool, pool.step_of([g.cache for g in groups], rows, torch.cat([g.positions for g in groups]))
            shape = self._step_under_way.shape = StepShape(
                groups,
                _parts([len(g) for g in groups]),
                groups[0].rotary if len(groups) == 1 else Rotary.cat([g.rotary for g in groups]),
                any(g.capture is not None for g in groups),
                pooled,
                self.int8_decoding and all(g.decoding for g in groups))
            shape.resolved = ResolvedStep.of(self, shape)
        return shape

    def run_layers(self, layers: Iterable[int], driver: LayerDriver) -> None:
        """The one loop over layers, under prefill, decode, every fusion plan and every restoration: at each
        layer the driver says which rows enter, and of which groups, and takes what the step gives back."""
        between = getattr(self._between_layers, "call", None)
        for i, layer in enumerate(layers):
            if i and between is not None:
                self._run_between_layers(between)
            hidden, groups = driver.enter(layer)
            driver.leave(layer, self.step(layer, hidden, groups))

    @contextmanager
    def between_layers(self, call: Callable[[], None]) -> Iterator[None]:
        """Run `call` between any two layers of the loops this thread runs meanwhile (not those `call` runs):
        a server's running sequences take their decoding steps while a long prompt is computed, instead of
        waiting for all of it. A loop's state lives in its driver and its cache, so a step of other rows in
        between leaves its results as they were (the step's shape is derived again, `_shape_of`)."""
        outer = getattr(self._between_layers, "call", None)
        self._between_layers.call = call
        try:
            yield
        finally:
            self._between_layers.call = outer

    def _run_between_layers(self, call: Callable[[], None]) -> None:
        self._between_layers.call = None
        started = time.perf_counter()
        try:
            call()
        finally:
            self._between_layers.call = call
            self._between_layers.seconds = self.seconds_between_layers() + time.perf_counter() - started

    def seconds_between_layers(self) -> float:
        """This thread's time in `between_layers` calls so far: a loop's own time is its wall time less the
        growth of this (FusionStats.prefill_seconds)."""
        return getattr(self._between_layers, "seconds", 0.0)

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor | list[int],
        cache: KVCache | None = None,
        start_position: int | None = None,
        capture_kv: bool = False,
    ) -> PrefillResult:
        """Compute `token_ids` after whatever `cache` holds (positions continue from it unless given)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}")
        if cache is None:
            cache = self.new_cache(ids.numel())
        if start_position is None:
            start_position = cache.next_position
        positions = torch.arange(start_position, start_position + ids.numel(), device=self.device)
        captured = CapturedKV() if capture_kv else None
        group = RowGroup(cache, cache.allocate(positions), positions,
                         self.rotary(range(start_position, start_position + ids.numel())),
                         capture=captured.record if captured else None)
        last_layer = self.num_layers - 1
        last = (last_layer, [replace(group, outputs=self.outputs_at(last_layer))]) if ids.numel() > 1 else None
        driver = Straight(self.embed(ids), [group], last)
        self.run_layers(range(self.num_layers), driver)
        result = PrefillResult(logits=self.logits(driver.hidden[-1:])[0], cache=cache)
        if captured is not None:
            result.keys, result.values = captured.stacked()
        return result

    def decode(self, token_id: int, cache: KVCache) -> torch.Tensor:
        """One decoding step: append `token_id` to `cache`, return the next-token logits."""
        return self.decode_batch([token_id], [cache])[0]

    @torch.inference_mode()
    def decode_batch(self, token_ids: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One decoding step for several sequences: token_ids[i] is appended to caches[i]; returns the
        next-token logits [len(token_ids), vocab]. One row group per sequence: the projections, MLP and LM head
        run on all rows at once, attention per sequence over its own cache."""
        if len(token_ids) != len(caches) or not caches:
            raise ValueError(f"decode_batch needs one token per cache, got {len(token_ids)} and {len(caches)}")
        positions = torch.tensor([cache.next_position for cache in caches], device=self.device)
        rotary = self.rotary(positions)
        groups = [RowGroup(cache, cache.allocate(positions[i : i + 1]), positions[i : i + 1], rotary[i : i + 1],
                           decoding=True)
                  for i, cache in enumerate(caches)]
        driver = Straight(self.embed(torch.tensor(token_ids, dtype=torch.long, device=self.device)), groups)
        self.run_layers(range(self.num_layers), driver)
        shape = self._step_under_way.shape
        return self.logits(driver.hidden, int8=shape.int8)


def _rotary_cacheable(rotary_emb: nn.Module) -> bool:
    """Whether a position's RoPE angles are the same in any call (no dynamic or longrope scaling), so that one table
    serves every call. `rope_type` is one type, or (Gemma 3's) a dict of them by kind of layer."""
    rope_type = getattr(rotary_emb, "rope_type", "default")
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return not any("dynamic" in kind or kind == "longrope" for kind in types)


def _pool_decoding(groups: Sequence[RowGroup]) -> KVPool | None:
    """The pool every group's cache lives in, when the groups are decoding rows that it can attend in one call:
    several groups of one row each, with nothing per group to run between their KV write and their attention."""
    pool = groups[0].cache.pool
    if pool is None or len(groups) < 2:
        return None
    for group in groups:
        if (group.cache.pool is not pool or len(group) != 1 or group.narrow is not None or group.observe is not None
                or group.keys_until is not None):
            return None
    return pool


def _single_row(rows: slice | torch.Tensor) -> int:
    return rows.start if isinstance(rows, slice) else int(rows)


def _parts(sizes: list[int]) -> list[slice]:
    """Consecutive slices of the given sizes: where each group's rows sit in a step's joined rows."""
    ends = list(itertools.accumulate(sizes))
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def _heads_side_by_side(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """Rows [n, Ha, D] and [n, Hb, D] whose heads lie next to each other in memory, b's right after a's in each
    row, as one view [n, Ha + Hb, D] of them; None if they do not."""
    rows, heads, dim = a.shape
    if (a.dtype != b.dtype or b.shape[0] != rows or b.shape[2] != dim or not native.heads_in_rows(a)
            or not native.heads_in_rows(b) or (rows > 1 and a.stride(0) != b.stride(0))  # one row's stride: any
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.data_ptr() != a.data_ptr() + heads * dim * a.element_size()):
        return None
    return a.as_strided((rows, heads + b.shape[1], dim), (a.stride(0), dim, 1))
