"""A decoding step's layers as native kernel calls whose arguments are resolved once per step.

A decoding step (one new row per sequence) spends about 16 ms of SmolLM2's 25-29 ms in its kernels for one
sequence; most of the rest was Python around them: per kernel call its checks, the weights' packing looked up and
verified, its outputs and working memory allocated, the step's views made. The step's shape is the same at every
layer, so `DecodeStep` checks it, allocates its buffers and resolves each layer's weights once, and a layer is
then four kernel calls (the input norm with the q/k/v product; RoPE of q and k together; the attention of each
sequence's query over its cache; the layer's end: o-projection, residual, norm, gated MLP) with the new KV's
write and a copy of the queries between them. The kernels and their order are the general step's
(`LayerwiseModel.step`), so the results are the same to the bit; steps it does not cover (narrowing, captures,
observers, a prompt's rows, a pool's sequences out of slot order, families with q/k norms) take the general step.
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


class _OwnCache:
    """One sequence decoding in a cache of its own (or alone in a pool): its layer's rows [capacity, heads, dim]."""

    def __init__(self, group: RowGroup):
        self.cache, self.rows = group.cache, group.rows
        self.lengths = torch.tensor([group.cache.length])
        self.q_pos = group.positions.contiguous()
        self.longest, self.sequences = group.cache.length, 1

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, self.rows, k, v)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], torch.Tensor, int]:
        """Keys and values, their (sequence, head, row) strides, their rows' positions and those positions' stride
        from one sequence to the next."""
        keys = self.cache.keys[layer]
        return keys, self.cache.values[layer], (0, keys.stride(1), keys.stride(0)), self.cache.positions, 0

    def takes(self) -> bool:
        keys, values = self.cache.keys[0], self.cache.values[0]
        return keys.stride() == values.stride() and keys.stride(-1) == 1


class _Pooled:
    """Sequences decoding in one pool, in the order of its slots: one attention call over the step's span."""

    def __init__(self, pool: KVPool, step: PooledStep):
        self.pool, self.step = pool, step
        self.lengths, self.q_pos = step.lengths, step.positions
        self.longest, self.sequences = step.end, step.span.stop - step.span.start

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.write_one_each(layer, self.step, k, v)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], torch.Tensor, int]:
        span = self.step.span
        keys, positions = self.pool.keys[layer][span], self.pool.positions[span]
        return keys, self.pool.values[layer][span], keys.stride()[:3], positions, positions.stride(0)

    def takes(self) -> bool:
        return self.step.in_order


class DecodeStep:
    """The layers of one decoding step of `len(groups)` sequences, each a few kernel calls (module docstring)."""

    def __init__(self, model: LayerwiseModel, weights: list[LayerWeights], target: _OwnCache | _Pooled,
                 shape: StepShape):
        self.model, self.weights, self.target = model, weights, target
        n, dtype = len(shape.groups), model.dtype
        self.q_heads, self.kv_heads, self.head_dim = model.num_q_heads, model.num_kv_heads, model.head_dim
        self.hidden_size, self.intermediate = model.hidden_size, weights[0].down.in_features
        self.bf16 = dtype == torch.bfloat16
        self.threads = torch.get_num_threads()
        self.scales = [layer.self_attn.scaling for layer in model.layers]
        # RoPE tables of the step's rows, [n, head_dim] per kind of RoPE
        self.cos = [table[:, 0] for table in shape.rotary.cos]
        self.sin = [table[:, 0] for table in shape.rotary.sin]
        self.norm_scratch = torch.empty(n * self.hidden_size, dtype=dtype)
        self.qkv = torch.empty(n, weights[0].qkv.out_features, dtype=dtype)
        self.rotated = torch.empty(n, self.q_heads + self.kv_heads, self.head_dim, dtype=dtype)
        q_width, kv_width = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        self.new_queries, self.new_keys = self.rotated[:, : self.q_heads], self.rotated[:, self.q_heads :]
        self.new_values = self.qkv[:, q_width + kv_width :].view(n, self.kv_heads, self.head_dim)
        # the attention kernel takes fp32 queries and writes fp32 (as `native.decode_attention` converts them)
        self.queries = torch.empty(target.sequences, self.q_heads, self.head_dim)
        self.attended = torch.empty(target.sequences, self.q_heads * self.head_dim)
        self.attended_rows = self.attended if not self.bf16 else torch.empty(n, self.q_heads * self.head_dim,
                                                                             dtype=dtype)
        parts = native.decode_attention_parts(target.sequences * self.kv_heads, target.longest, self.threads)
        groups = self.q_heads // self.kv_heads
        self.attention_scratch = torch.empty(self.threads * groups * target.longest
                                             + target.sequences * self.kv_heads * parts * groups * (self.head_dim + 2))
        self.layer_end_scratch = native.layer_end_intermediates(n, self.hidden_size, self.intermediate, dtype)
        # each layer's output goes to the buffer its input is not in
        self.outputs = [torch.empty(n, self.hidden_size, dtype=dtype) for _ in range(2)]

    @staticmethod
    def of(model: LayerwiseModel, shape: StepShape) -> DecodeStep | None:
        """The step of these groups, or None where the general step must run it: rows that are not one new row
        per sequence with nothing to run between its KV write and its attention; a pool's sequences out of its
        slots' order; a dtype, family or layer the kernels do not take."""
        groups = shape.groups
        if (not native.panels_take(model.dtype) or model.device.type != "cpu" or model.head_dim % 2 or any(
                    len(g) != 1 or g.narrow is not None or g.capture is not None or g.observe is not None
                    or g.outputs is not None or g.keys_until is not None for g in groups)):
            return None
        if shape.pooled is not None:
            target: _OwnCache | _Pooled = _Pooled(*shape.pooled)
        elif len(groups) == 1:
            target = _OwnCache(groups[0])
        else:
            return None
        if not target.takes() or not all(_rows_of_one_layout(c, s) for c, s in zip(shape.rotary.cos,
                                                                                     shape.rotary.sin)):
            return None
        rows = torch.empty(len(groups), model.hidden_size, dtype=model.dtype)  # what the layers will take
        weights = [model.adapter.native_layer(block, rows) for block in model.layers]
        if any(w is None for w in weights):
            return None
        return DecodeStep(model, weights, target, shape)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether these rows entering a layer are what the calls read: contiguous, in the model's dtype."""
        return hidden.dtype == self.model.dtype and hidden.is_contiguous()

    def run_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """`LayerwiseModel.step` of the step's rows at `layer`: the rows' output, [n, hidden]."""
        lib, w, threads, bf16 = native.library(), self.weights[layer], self.threads, self.bf16
        n, hidden_size, q_width = hidden.shape[0], self.hidden_size, self.q_heads * self.head_dim
        lib.normed_panel_rows(hidden.data_ptr(), hidden_size, n, hidden_size, w.input_norm.data_ptr(), w.input_eps,
                              w.qkv.panels.data_ptr(), w.qkv.out_features, native.pointer(w.qkv.bias),
                              self.norm_scratch.data_ptr(), self.qkv.data_ptr(), threads, bf16)
        kind = self.model.rope_kind_of_layer[layer]
        cos, sin, rotated = self.cos[kind], self.sin[kind], self.rotated
        lib.rope(self.qkv.data_ptr(), self.qkv.stride(0), n, self.q_heads + self.kv_heads, self.head_dim,
                 cos.data_ptr(), sin.data_ptr(), cos.stride(0), rotated.data_ptr(), rotated.stride(0), threads, bf16)
        self.target.write(layer, self.new_keys, self.new_values)
        self._attend(layer)
        out = self.outputs[0] if hidden.data_ptr() != self.outputs[0].data_ptr() else self.outputs[1]
        scratch = self.layer_end_scratch
        lib.layer_end(self.attended_rows.data_ptr(), n, q_width, hidden.data_ptr(), hidden_size,
                      w.o_proj.panels.data_ptr(), native.pointer(w.o_proj.bias), w.post_norm.data_ptr(), w.post_eps,
                      w.gate_up.panels.data_ptr(), native.pointer(w.gate_up.bias), self.intermediate,
                      w.down.panels.data_ptr(), native.pointer(w.down.bias), *(t.data_ptr() for t in scratch),
                      out.data_ptr(), threads, bf16)
        return out

    def _attend(self, layer: int) -> None:
        """Each sequence's new query over its cache, causal by position (and within the layer's window)."""
        target = self.target
        keys, values, (sequence_stride, head_stride, row_stride), positions, positions_stride = target.kv(layer)
        self.queries.copy_(self.new_queries)
        window = self.model.windows[layer]
        native.library().decode_attention(
            self.queries.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.dtype == torch.bfloat16,
            sequence_stride, head_stride, row_stride, positions.data_ptr(), positions_stride,
            target.lengths.data_ptr(), target.q_pos.data_ptr(), target.sequences, self.kv_heads,
            self.q_heads // self.kv_heads, self.head_dim, target.longest, window or 0,
            self.scales[layer], self.attention_scratch.data_ptr(), self.attended.data_ptr(),
            self.threads)
        if self.bf16:
            self.attended_rows.copy_(self.attended)


def _rows_of_one_layout(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """RoPE tables [n, 1, head_dim] as `native.rope` takes them: contiguous rows, one stride for both."""
    return cos.stride() == sin.stride() and cos.stride(-1) == 1
