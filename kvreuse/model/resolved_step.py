"""A step's layers as native kernel calls whose arguments are resolved once per step.

A decoding step (one new row per sequence) spent about 16 ms of SmolLM2's 25-29 ms in its kernels for one
sequence; most of the rest was Python around them: per kernel call its checks, the weights' packing looked up and
verified, its outputs and working memory allocated, the step's views made. A step's shape is the same at every
layer, so `ResolvedStep` checks it and allocates its buffers once, takes each layer's weights as the adapter
resolved them (`native_layers`: kept between steps while the weights are unchanged), and a layer is
then four kernel calls (the input norm with the q/k/v product; RoPE of q and k together; the attention of the
rows' queries over their cache; the layer's end: o-projection, residual, norm, gated MLP) with the new KV's write
between them. The kernels and their order are the general step's (`LayerwiseModel.step`), so the results are the
same to the bit. It runs the rows of one request (a prompt's, a plan's recomputed rows, one decoding row) and a
pool's decoding rows; steps it does not cover (several requests' prompts, narrowing, captures, observers, a last
layer's rows cut to the last, a pool's sequences out of slot order, a cache or pool not laid out as the kernels read
it, families with q/k norms) take the general step, whose kernels check what they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvreuse.model import native

if TYPE_CHECKING:
    from kvreuse.model.kv_pool import KVPool, PooledStep
    from kvreuse.model.runtime import LayerwiseModel, RowGroup, StepShape


@dataclass(frozen=True)
class LayerWeights:
    """A Llama-family layer's norms and products as the native kernels take them (`native.normed_panel_rows` and
    `native.layer_end`): what the adapter resolves for a step of rows like the step's."""

    input_norm: torch.Tensor
    input_eps: float
    qkv: native.Panels
    o_proj: native.Panels
    post_norm: torch.Tensor
    post_eps: float
    gate_up: native.Panels
    down: native.Panels


class _OneRequest:
    """The rows of one request, in its cache: its new KV written at their rows, their queries over the cache's rows
    by position, in the decoding kernel for one row (as `attention.attend` runs it) and the prefill kernel for more."""

    def __init__(self, model: LayerwiseModel, group: RowGroup, threads: int):
        self.cache, self.rows, self.q_pos = group.cache, group.rows, group.positions.contiguous()
        self.rows_count, self.keys_count = len(group), group.cache.length
        self.groups, self.dim, self.threads = model.num_q_heads // model.num_kv_heads, model.head_dim, threads
        self.bf16 = model.dtype == torch.bfloat16
        if self.rows_count == 1:
            self.one_query = OneQueryEach(model, 1, self.keys_count, torch.tensor([self.keys_count]), self.q_pos,
                                           threads)
        else:
            self.block = native.prefill_attention_block(self.rows_count, self.groups)
            self.scratch = torch.empty(native.library().prefill_attention_scratch(
                self.keys_count, model.num_kv_heads, self.groups, self.dim, self.block, threads, self.bf16),
                dtype=torch.uint8)

    @staticmethod
    def takes(group: RowGroup, dtype: torch.dtype) -> bool:
        """Whether the kernels read the group's cache as it is laid out, in the model's `dtype` (the prefill kernel
        reads the cache as the queries' dtype: bf16 read as fp32 would be twice its bytes)."""
        keys, values = group.cache.keys[0], group.cache.values[0]
        return (keys.dtype == values.dtype == dtype and keys.stride() == values.stride() and keys.stride(-1) == 1
                and (len(group) == 1  # the prefill kernel reads rows of contiguous heads, of whole vectors
                     or (native.heads_in_rows(keys) and native.prefill_attention_takes(keys.shape[-1]))))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, self.rows, k, v)

    def attend(self, layer: int, queries: torch.Tensor, out: torch.Tensor, window: int | None, scale: float) -> None:
        keys, values, positions = self.cache.keys[layer], self.cache.values[layer], self.cache.positions
        if self.rows_count == 1:
            self.one_query.attend(keys, values, (0, keys.stride(1), keys.stride(0)), positions, 0, queries, out,
                                  window, scale)
            return
        native.library().prefill_attention(
            queries.data_ptr(), queries.stride(0), self.q_pos.data_ptr(), self.rows_count, keys.data_ptr(),
            values.data_ptr(), keys.stride(0), positions.data_ptr(), self.keys_count, keys.shape[1], self.groups,
            self.dim, window or 0, scale, self.block, self.scratch.data_ptr(), out.data_ptr(), self.threads,
            self.bf16)


class _Pooled:
    """Decoding rows of a pool's sequences, in the order of its slots: one attention call over the step's span."""

    def __init__(self, model: LayerwiseModel, pool: KVPool, step: PooledStep, threads: int):
        self.pool, self.step = pool, step
        self.one_query = OneQueryEach(model, step.span.stop - step.span.start, step.end, step.lengths,
                                       step.positions, threads)

    @staticmethod
    def takes(pool: KVPool, step: PooledStep) -> bool:
        """Whether the kernel reads the pool as it is laid out: the step's caches fill their span in slot order, and
        every layer's keys and values are of one shape, layout and dtype (the kernel reads both by the keys' strides,
        unchecked) with the step's rows. A pool whose growth failed part way would not be; checked once a step (about
        20 us for 30 layers)."""
        return (step.in_order and len(pool.keys) == len(pool.values) and pool.positions.shape[1] >= step.end
                and all(k.shape == v.shape and k.stride() == v.stride() and k.dtype == v.dtype
                        and k.shape[2] >= step.end for k, v in zip(pool.keys, pool.values)))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.write_one_each(layer, self.step, k, v)

    def attend(self, layer: int, queries: torch.Tensor, out: torch.Tensor, window: int | None, scale: float) -> None:
        span = self.step.span
        keys, positions = self.pool.keys[layer][span], self.pool.positions[span]
        self.one_query.attend(keys, self.pool.values[layer][span], keys.stride()[:3], positions, positions.stride(0),
                              queries, out, window, scale)


class OneQueryEach:
    """The decoding kernel's call for one query per sequence (`native.decode_attention`): fp32 queries in, fp32 out,
    as that function converts them."""

    def __init__(self, model: LayerwiseModel, sequences: int, longest: int, lengths: torch.Tensor,
                 q_pos: torch.Tensor, threads: int):
        self.sequences, self.longest, self.lengths, self.q_pos = sequences, longest, lengths, q_pos
        self.threads, self.heads, self.dim = threads, model.num_kv_heads, model.head_dim
        self.groups = model.num_q_heads // model.num_kv_heads
        self.queries = torch.empty(sequences, model.num_q_heads, self.dim)
        self.out = torch.empty(sequences, model.num_q_heads * self.dim)
        self.scratch = native.decode_attention_scratch(sequences, self.heads, self.groups, self.dim, longest, threads)

    def attend(self, keys: torch.Tensor, values: torch.Tensor, strides: tuple[int, int, int], positions: torch.Tensor,
               positions_stride: int, queries: torch.Tensor, out: torch.Tensor, window: int | None,
               scale: float) -> None:
        """Queries [sequences, Hq, D] over keys and values with (sequence, head, row) strides, whose rows sit at
        `positions` (rows of `positions_stride` from one sequence to the next), into out [sequences, Hq * D]."""
        self.queries.copy_(queries)
        native.library().decode_attention(
            self.queries.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.dtype == torch.bfloat16, *strides,
            positions.data_ptr(), positions_stride, self.lengths.data_ptr(), self.q_pos.data_ptr(), self.sequences,
            self.heads, self.groups, self.dim, self.longest, window or 0, scale, self.scratch.data_ptr(),
            self.out.data_ptr(), self.threads)
        out.copy_(self.out)


class ResolvedStep:
    """The layers of one step of `shape`'s rows, each a few kernel calls (module docstring)."""

    def __init__(self, model: LayerwiseModel, weights: list[LayerWeights], target: _OneRequest | _Pooled,
                 shape: StepShape):
        self.model, self.weights, self.target, dtype = model, weights, target, model.dtype
        n = sum(len(g) for g in shape.groups)
        self.cos = [table[:, 0] for table in shape.rotary.cos]  # [n, head_dim] per kind of RoPE
        self.sin = [table[:, 0] for table in shape.rotary.sin]
        self.q_heads, self.kv_heads, self.head_dim = model.num_q_heads, model.num_kv_heads, model.head_dim
        self.hidden_size, self.intermediate = model.hidden_size, weights[0].down.in_features
        self.bf16 = dtype == torch.bfloat16
        self.threads = torch.get_num_threads()
        self.scales = [layer.self_attn.scaling for layer in model.layers]
        self.norm_scratch = torch.empty(n * self.hidden_size, dtype=dtype)
        self.qkv = torch.empty(n, weights[0].qkv.out_features, dtype=dtype)
        self.rotated = torch.empty(n, self.q_heads + self.kv_heads, self.head_dim, dtype=dtype)
        q_width, kv_width = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.new_queries, self.new_keys = self.rotated[:, : self.q_heads], self.rotated[:, self.q_heads :]
        self.new_values = self.qkv[:, q_width + kv_width :].view(n, self.kv_heads, self.head_dim)
        self.attended = torch.empty(n, q_width, dtype=dtype)
        self.layer_end_scratch = native.layer_end_intermediates(n, self.hidden_size, self.intermediate, dtype)
        # each layer's output goes to the buffer its input is not in
        self.outputs = [torch.empty(n, self.hidden_size, dtype=dtype) for _ in range(2)]

    @staticmethod
    def of(model: LayerwiseModel, shape: StepShape) -> ResolvedStep | None:
        """The step of these groups, or None where the general step must run it (module docstring)."""
        groups = shape.groups
        if (not native.panels_take(model.dtype) or model.device.type != "cpu" or model.head_dim % 2
                or any(g.narrow is not None or g.capture is not None or g.observe is not None
                       or g.outputs is not None or g.keys_until is not None for g in groups)
                or not all(_rows_of_one_layout(c, s) for c, s in zip(shape.rotary.cos, shape.rotary.sin))):
            return None
        # checked before the targets' buffers are allocated: a step the general step runs allocates nothing here
        pooled = shape.pooled
        if not (_Pooled.takes(*pooled) if pooled is not None
                else len(groups) == 1 and _OneRequest.takes(groups[0], model.dtype)):
            return None
        weights = model.adapter.native_layers(sum(len(g) for g in groups), model.dtype, shape.int8)
        if weights is None:
            return None
        threads = torch.get_num_threads()
        target = _Pooled(model, *pooled, threads) if pooled is not None else _OneRequest(model, groups[0], threads)
        return ResolvedStep(model, weights, target, shape)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether these rows entering a layer are what the calls read: contiguous, in the model's dtype."""
        return hidden.dtype == self.model.dtype and hidden.is_contiguous()

    def run_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """`LayerwiseModel.step` of the step's rows at `layer`: the rows' output, [n, hidden]."""
        lib, w, threads, bf16 = native.library(), self.weights[layer], self.threads, self.bf16
        n, hidden_size, q_width = hidden.shape[0], self.hidden_size, self.q_heads * self.head_dim
        lib.normed_panel_rows(hidden.data_ptr(), hidden_size, n, hidden_size, w.input_norm.data_ptr(), w.input_eps,
                              w.qkv.panels.data_ptr(), w.qkv.out_features, native.pointer(w.qkv.bias),
                              self.norm_scratch.data_ptr(), self.qkv.data_ptr(), threads, w.qkv.format)
        kind = self.model.rope_kind_of_layer[layer]
        cos, sin, rotated = self.cos[kind], self.sin[kind], self.rotated
        lib.rope(self.qkv.data_ptr(), self.qkv.stride(0), n, self.q_heads + self.kv_heads, self.head_dim,
                 cos.data_ptr(), sin.data_ptr(), cos.stride(0), rotated.data_ptr(), rotated.stride(0), threads, bf16)
        self.target.write(layer, self.new_keys, self.new_values)
        self.target.attend(layer, self.new_queries, self.attended, self.model.windows[layer], self.scales[layer])
        out = self.outputs[0] if hidden.data_ptr() != self.outputs[0].data_ptr() else self.outputs[1]
        lib.layer_end(self.attended.data_ptr(), n, q_width, hidden.data_ptr(), hidden_size,
                      w.o_proj.panels.data_ptr(), native.pointer(w.o_proj.bias), w.post_norm.data_ptr(), w.post_eps,
                      w.gate_up.panels.data_ptr(), native.pointer(w.gate_up.bias), self.intermediate,
                      w.down.panels.data_ptr(), native.pointer(w.down.bias),
                      *(t.data_ptr() for t in self.layer_end_scratch), out.data_ptr(), threads, w.o_proj.format)
        return out


def _rows_of_one_layout(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """RoPE tables [n, 1, head_dim] as `native.rope` takes them: contiguous rows, one stride for both."""
    return cos.stride() == sin.stride() and cos.stride(-1) == 1
