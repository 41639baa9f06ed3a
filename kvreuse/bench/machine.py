"""What this machine can do for a model's prefill and decoding, measured here: the matmul rate on the model's own
layer shapes and the memory bandwidth, and the floor they set for a prefill of n tokens or a decoding step. A
benchmark divides this floor by what it measured (achieved / limit): how far an engine is from the cores, not from
another engine.

The floor is a lower bound: every FLOP of the prefill (projections, MLP, causal attention over every earlier
token, the LM head for the last row) at the best rate the model's dense shapes reach here, or its weights read
once from memory, whichever is longer. Sliding-window layers are counted as global, so their floor is lower
than the work they do. A decoding step's floor is mostly its reads: the weights once, and every sequence's KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from kvreuse.model import native
from kvreuse.model.linear import linear, route as linear_route
from kvreuse.model.runtime import LayerwiseModel

BANDWIDTH_BYTES = 256 << 20  # large enough that no cache holds it


@dataclass(frozen=True)
class MachineLimit:
    dtype: str
    rows: int  # the row count the matmul rate was measured at
    dense_flops_per_second: float  # the model's layer projections and MLP, all of them, at `rows` rows
    bytes_per_second: float  # a large copy: bytes read plus bytes written, per second
    route: str  # the fastest of torch's own product, kvreuse.model.linear's (its `route`) and the panels in passes

    def floor_seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.dense_flops_per_second, nbytes / self.bytes_per_second)


def layer_linears(model: LayerwiseModel) -> list[nn.Linear]:
    """The matmuls of one decoder layer (q, k, v, o, the MLP's), as the model defines them."""
    return [m for m in model.layers[0].modules() if isinstance(m, nn.Linear)]


def prefill_flops(model: LayerwiseModel, tokens: int) -> float:
    """FLOPs of a full prefill of `tokens` tokens: 2 per multiply-add of every layer's projections and MLP, causal
    attention (QK^T and AV over each row's earlier keys, every query head), and the LM head for the last row."""
    dense = sum(m.in_features * m.out_features for m in layer_linears(model))
    attention = 2 * 2 * model.num_q_heads * model.head_dim * tokens * (tokens + 1) / 2
    head = model.hf_model.lm_head
    return model.num_layers * (2 * tokens * dense + attention) + 2 * head.in_features * head.out_features


def weight_bytes(model: LayerwiseModel) -> int:
    """Bytes of the weights a step reads: every parameter but an input embedding table of its own (a step gathers
    only its tokens' rows of it; tied to the LM head, the LM head reads it whole)."""
    total = sum(p.numel() * p.element_size() for p in model.hf_model.parameters())
    embedding, head = model.hf_model.get_input_embeddings().weight, model.hf_model.lm_head.weight
    return total if embedding.data_ptr() == head.data_ptr() else total - embedding.numel() * embedding.element_size()


def decode_step_flops(model: LayerwiseModel, batch: int, context: int) -> float:
    """FLOPs of one decoding step of `batch` sequences of `context` tokens each: every layer's projections and MLP
    and attention over the whole context for one row per sequence, and the LM head for each."""
    dense = sum(m.in_features * m.out_features for m in layer_linears(model))
    attention = 2 * 2 * model.num_q_heads * model.head_dim * context
    head = model.hf_model.lm_head
    return batch * (model.num_layers * (2 * dense + attention) + 2 * head.in_features * head.out_features)


def decode_step_bytes(model: LayerwiseModel, batch: int, context: int) -> int:
    """Bytes one decoding step must read at least: the weights once, and every sequence's keys and values."""
    kv_row = 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize
    return weight_bytes(model) + batch * context * kv_row


# rows [n, in] through a group of projections sharing that input
Product = Callable[[torch.Tensor, Sequence[nn.Linear]], object]


def routes(rows: torch.Tensor, group: Sequence[nn.Linear]) -> dict[str, Product]:
    """The ways to run a layer's products that `measure` times, named as the floor reports them, for `rows` through
    `group`: torch's own product, kvreuse.model.linear's (by its `route`), and past the rows native's panels take,
    the panels in passes of that many rows where linear sends a pass there."""
    found: dict[str, Product] = {"torch": lambda x, layers: [nn.functional.linear(x, m.weight, m.bias) for m in layers]}
    ours = linear_route(rows, *group)
    if ours != "torch":
        found[ours] = lambda x, layers: linear(x, *layers)
    passes = native.most_panel_rows(rows.dtype)
    if 0 < passes < rows.shape[0] and linear_route(rows[:passes], *group) == "panels":
        found[f"panels, {passes}-row passes"] = lambda x, layers: [linear(x[start : start + passes], *layers)
                                                                   for start in range(0, x.shape[0], passes)]
    return found


@torch.inference_mode()
def measure(model: LayerwiseModel, rows: int = 2048, repeats: int = 5) -> MachineLimit:
    """The best of `repeats` timings of one layer's matmuls at `rows` rows, by torch's own product (MKL for fp32)
    and by kvreuse.model.linear's (named by its `route`), and of a large copy. Past the rows native's panels take,
    also by the panels in passes of that many rows: any product of more rows could run so (a long prefill's MLP
    does), so the floor takes that rate where it is the best."""
    linears = layer_linears(model)
    flops = sum(2 * rows * m.in_features * m.out_features for m in linears)
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=model.dtype) for m in linears}
    # Each route runs the layer's products as the runtime groups them (projections sharing an input stacked).
    groups = model.adapter.products(model.layers[0])

    def layer_matmuls(product: Product) -> Callable[[], None]:
        return lambda: [product(inputs[group[0].in_features], group) for group in groups]

    first = inputs[groups[0][0].in_features], groups[0]
    seconds = {name: _best(layer_matmuls(product), repeats) for name, product in routes(*first).items()}
    route = min(seconds, key=seconds.get)
    source = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    copy = _best(lambda: target.copy_(source), repeats)
    return MachineLimit(str(model.dtype).removeprefix("torch."), rows, flops / seconds[route], 2 * source.nbytes / copy,
                        route)


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
