"""The one matrix product every projection of the runtime goes through (q/k/v, output, MLP, LM head).

Products run in oneDNN, on each weight reordered once into oneDNN's blocked layout. torch's own fp32 product
calls MKL, which runs its AVX2 code on AMD CPUs: on an AMD EPYC with AVX512 (Zen 5), SmolLM2's projections
reached 210-217 GFLOP/s through MKL and 475-505 through packed oneDNN at 1-2K rows, 120-150 against 250-325
at 16 rows (tests/model/test_linear.py pins the results, `kvreuse bench prefill` the speed). bf16 products go
to oneDNN either way; packed they gain most at a few rows (1.9x at 16, which is decoding). The packs are copies:
the projections' weights take twice their size in memory (SmolLM2 in fp32: 0.54 GB more).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN lays a packed weight out for; the layout serves any row count (checked at 1-2048 rows:
# within 4% of a weight packed for that count).
PACK_FOR_ROWS = 2048


@dataclass
class _Packed:
    source: torch.Tensor  # the weight it was made from, to notice a weight replaced or changed in place
    version: int | None
    weight: torch.Tensor


_packed: weakref.WeakKeyDictionary[nn.Linear, _Packed] = weakref.WeakKeyDictionary()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(rows: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(rows) for rows [n, in_features]."""
    if not _packs(layer.weight):
        return nn.functional.linear(rows, layer.weight, layer.bias)
    bias = None if layer.bias is None else layer.bias.detach()
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), _packed_weight(layer), bias, "none", [], "")


def pack_weights(model: nn.Module) -> None:
    """Pack every projection of `model` now, so that its first request does not pay for it (about 0.25 s for
    SmolLM2's 211 projections)."""
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and _packs(layer.weight):
            _packed_weight(layer)


def _packs(weight: torch.Tensor) -> bool:
    return _ONEDNN and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def _packed_weight(layer: nn.Linear) -> torch.Tensor:
    weight = layer.weight
    packed = _packed.get(layer)
    if packed is None or packed.source is not weight or packed.version != _version(weight):
        with torch.no_grad():
            packed = _Packed(weight, _version(weight), torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS))
        _packed[layer] = packed
    return packed.weight


def _version(weight: torch.Tensor) -> int | None:
    # Tensors made under inference mode keep no version counter (and a loaded model's weights are not such).
    return None if weight.is_inference() else weight._version


_ONEDNN = onednn_available()
