"""The one matrix product every projection of the runtime goes through (q/k/v, output, MLP, LM head).

Products the panels (below) do not take run in oneDNN, on each weight reordered once into oneDNN's blocked layout.
torch's own fp32 product calls MKL, which runs its AVX2 code on AMD CPUs: on an AMD EPYC with AVX512 (Zen 5),
SmolLM2's projections reached 210-217 GFLOP/s through MKL and 475-505 through packed oneDNN at 1-2K rows, 120-150
against 250-325 at 16 rows (tests/model/test_linear.py pins the results, `kvreuse bench prefill` the speed). bf16
products the panels do not take go to oneDNN either way; packed they gain most at a few rows (1.9x at 16, which is
decoding). The packs are copies: the projections' weights take twice their size in memory (SmolLM2 in fp32: 0.54 GB
more).

Up to native.most_panel_rows(dtype) rows (fp32 any number with AVX-512 and AMX, 2048 with AVX-512 alone or AVX2,
bf16 1024 with AVX-512: a decoding step, a prefill's logits, the rows a reuse method recomputes, and fp32 prompts
with AVX-512, whose layers then run as native calls resolved once) run in kvreuse.model.native's `panel_rows`, over
another copy of each weight laid out in panels of outputs: every weight is read from memory once per step, in order,
while the products run close to the FMA units' rate, where oneDNN's product of a few rows does neither (on a 2-core
Zen 4 EPYC, SmolLM2's fp32 projections 1.25-1.35x faster at 16 rows, 1.09x at 96, level from 1024; 1.25-1.37x faster
at 1-3 rows than dot products over the plain weights; bf16 1.3x at 16 rows). That copy is another 0.54 GB for
SmolLM2 in fp32 (0.27 in bf16); oneDNN's copy is made only once a product runs there, so fp32 with AVX-512 and AMX
does without it. bf16 takes the panels where the CPU has AVX512-BF16; elsewhere a bf16 layer's 1-3 rows go to
native's `few_rows`, over the plain weights. Where the CPU has AMX-BF16, the panels multiply bf16 in AMX tiles, and
oneDNN too, 2-9x vdpbf16ps's rate from 16 rows on: there bf16 takes the panels (in the tiles) up to 32 rows, what a
decoding step's products read from memory (`native.AMX_BF16_PANEL_ROWS`), and oneDNN past that.

Projections that take the same input (q/k/v; the MLP's gate and up) run as one product over their weights
stacked: one call instead of three or two, over a wider output. SmolLM2 in fp32 on a Zen 4 EPYC, each form
alternated in one process: a decoding step of one sequence went from 40.1 to 36.7 ms (weight reads at one row
pay a per-call cost), a 2K-token prefill was unchanged (3.34 s).

A model that decodes in int8 (LayerwiseModel.decode_in_int8, an option) runs its decoding steps over one more copy
of each stacked weight, in int8 panels with a scale per output (`int8_panels`): a quarter of fp32's bytes, which is
what a decoding step of a few rows waits on (0.14 GB more for SmolLM2).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from kvreuse.model import native

# oneDNN (and ideep, torch's layer over it) keep every product's primitive for its row count, 1024 of each by
# default, and a primitive holds buffers of its shape's size: SmolLM2's q/k/v, gate/up and down products kept 25.6
# MB more for each new prompt length past the panels' rows (a Zen 4 EPYC, fp32, 2.1K rows), so a server given
# prompts of many lengths grew by gigabytes. Both caches read their capacity once, when their first primitive is
# made: set here, before any product runs (a setting of the user's stands). Making a primitive again costs little
# beside its product: about 10 ms against 50 for 3K rows of gate/up.
ONEDNN_CACHED_PRIMITIVES = 16
# Those set here, not by the user: a peer engine the benches start (vLLM) is run without them, in its own settings.
ONEDNN_CAPACITIES_SET = tuple(name for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
                              if name not in os.environ)
os.environ.update(dict.fromkeys(ONEDNN_CAPACITIES_SET, str(ONEDNN_CACHED_PRIMITIVES)))

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The row count oneDNN lays a packed weight out for; the layout serves any row count (checked at 1-2048 rows:
# within 4% of a weight packed for that count).
PACK_FOR_ROWS = 2048


@dataclass
class _Packed:
    # The weights and biases it was made from, to notice one replaced or changed in place.
    sources: tuple[torch.Tensor | None, ...]
    versions: tuple[int | None, ...]
    onednn: torch.Tensor | None  # the stacked weight in oneDNN's layout (fp32, bf16; or bf16 widened to fp32)
    panels: native.Panels | None  # the stacked weight in native.panel_rows' layout, with its outputs and bias
    bias: torch.Tensor | None

    @staticmethod
    def of(layers: Sequence[nn.Linear], panels: native.Panels | None, bias: torch.Tensor | None) -> _Packed:
        """Packed forms of `layers`' weights (oneDNN's added when first asked for), remembering the tensors (and
        versions) they were made from."""
        sources = tuple(t for layer in layers for t in (layer.weight, layer.bias))
        return _Packed(sources, tuple(_version(t) for t in sources), None, panels, bias)

    def made_from(self, layers: Sequence[nn.Linear]) -> bool:
        """Whether `layers` still hold the very tensors it was made from, unchanged. Asked before every product
        (a decoding step makes about 120): a plain loop that stops at the first difference, where building the
        tuples to compare took most of a product's time outside the kernel."""
        if len(self.sources) != 2 * len(layers):
            return False
        for i, layer in enumerate(layers):
            # Where `layer.weight` finds them (nn.Module's __getattr__), without the cost of its fallback chain.
            parameters = layer._parameters
            weight, bias = parameters["weight"], parameters.get("bias")
            if (weight is not self.sources[2 * i] or bias is not self.sources[2 * i + 1]
                    or _version(weight) != self.versions[2 * i] or _version(bias) != self.versions[2 * i + 1]):
                return False
        return True


# Keyed by the first layer of the stacked group.
_packed: weakref.WeakKeyDictionary[nn.Linear, _Packed] = weakref.WeakKeyDictionary()
# The same groups' weights in int8 (`int8_panels`), for a model that decodes in int8; only its panels are set.
_packed_int8: weakref.WeakKeyDictionary[nn.Linear, _Packed] = weakref.WeakKeyDictionary()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(rows: torch.Tensor, *layers: nn.Linear, plus: torch.Tensor | None = None, int8: bool = False
           ) -> torch.Tensor:
    """rows [n, in_features] through each of `layers` (which all take that input): their outputs side by side,
    [n, sum of their out_features], as one product; `plus` (of that shape: a residual) added to it if given.
    `int8`: over the layers' weights in int8 (a model decoding in int8, LayerwiseModel.decode_in_int8)."""
    if int8:
        return linear_int8(rows, *layers, plus=plus)
    panels = in_panels(rows, *layers)
    if panels is not None:
        return native.panel_rows(rows, panels.panels, panels.out_features, panels.bias, plus)
    taken = route(rows, *layers)
    if taken == "few-rows":
        return _plus(_few_rows(rows, layers), plus)
    if taken == "torch":
        outputs = [nn.functional.linear(rows, layer.weight, layer.bias) for layer in layers]
        return _plus(outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1), plus)
    packed = _packed_weights(layers, onednn=True)
    if taken == "onednn-widened":  # a bf16 layer's weight widened: its product rounded to bf16
        product = torch.ops.mkldnn._linear_pointwise(rows.float().contiguous(), packed.onednn,
                                                     None if packed.bias is None else packed.bias.float(), "none",
                                                     [], "")
        return _plus(product.to(layers[0].weight.dtype), plus)
    if plus is not None and rows.dtype == torch.float32:
        # Added to the fp32 sums as oneDNN writes them: the same sum as after, with no pass over the output.
        # (bf16 adds after, to a product rounded to bf16, as transformers' modules do.)
        return torch.ops.mkldnn._linear_pointwise.binary(rows.contiguous(), plus.contiguous(), packed.onednn,
                                                         packed.bias, "add")
    return _plus(torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed.onednn, packed.bias, "none", [], ""),
                 plus)


def route(rows: torch.Tensor, *layers: nn.Linear) -> str:
    """Which product `linear` runs these rows through these layers on: native's "panels" (up to
    native.most_panel_rows(dtype) rows of the weight's dtype), native's "few-rows" (1-3 bf16 rows over the plain
    weights), oneDNN on the packed weight ("onednn-packed", or "onednn-widened": a bf16 weight packed in fp32
    where oneDNN has no bf16 path), or torch's own product ("torch")."""
    weight = layers[0].weight
    if _rows_for_panels(rows, weight.dtype) and _in_panels(weight):
        return "panels"
    if rows.shape[0] <= native.FEW_ROWS and _native_few_rows(rows, layers):
        return "few-rows"
    packed_in = onednn_dtype(weight)
    if packed_in is None:
        return "torch"
    return "onednn-packed" if packed_in == weight.dtype else "onednn-widened"


def in_panels(rows: torch.Tensor, *layers: nn.Linear) -> native.Panels | None:
    """The layers' weights stacked in panels when `linear` runs these rows (or rows of their count and dtype)
    through them there (`route`'s "panels"), else None: also what the native kernels that run a layer's parts in
    one call take. Asked before every product of a few rows, so the weights packed as they are answer first."""
    packed = _packed.get(layers[0])
    if packed is None or packed.panels is None or not packed.made_from(layers):
        return _packed_weights(layers).panels if route(rows, *layers) == "panels" else None
    return packed.panels if _rows_for_panels(rows, packed.panels.panels.dtype) else None


def _rows_for_panels(rows: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `panel_rows` takes these rows through a weight of `dtype` in panels: its own dtype, up to
    native.most_panel_rows(dtype) of them."""
    return 0 < rows.shape[0] <= native.most_panel_rows(dtype) and rows.dtype == dtype


def _plus(product: torch.Tensor, plus: torch.Tensor | None) -> torch.Tensor:
    return product if plus is None else product.add_(plus)  # in place: no output to allocate


def _native_few_rows(rows: torch.Tensor, layers: Sequence[nn.Linear]) -> bool:
    """Whether native.few_rows takes these: bf16 rows through bf16 layers, every weight contiguous."""
    return (rows.shape[0] > 0 and rows.dtype == torch.bfloat16 and rows.device.type == "cpu"
            and all(layer.weight.is_contiguous() for layer in layers)
            and native.runs_fp32_or_bf16(rows, *(t for layer in layers for t in (layer.weight, layer.bias)
                                              if t is not None)))


def _few_rows(rows: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """A few rows through each layer into its own columns of one output."""
    out = rows.new_empty((rows.shape[0], sum(layer.out_features for layer in layers)))
    rows, start = rows.contiguous(), 0
    for layer in layers:
        bias = None if layer.bias is None else layer.bias.detach().contiguous()
        native.few_rows(rows, layer.weight.detach(), bias, out[:, start : start + layer.out_features])
        start += layer.out_features
    return out


def pack_weights(groups: Iterable[Sequence[nn.Linear]]) -> None:
    """Pack every group of projections now (each group stacked as `linear` runs it), so that the first request
    does not pay for it (about 0.25 s for SmolLM2)."""
    for layers in groups:
        weight = layers[0].weight
        if _in_onednn(weight) or _in_panels(weight):
            _packed_weights(tuple(layers), onednn=_in_onednn(weight) and not _panels_take_any_rows(weight))


def _in_onednn(weight: torch.Tensor) -> bool:
    return onednn_dtype(weight) is not None


def onednn_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype oneDNN multiplies `weight` in: its own, or fp32 for a bf16 weight where oneDNN has no bf16 path.
    Widened, bf16's products are the same exact products summed in fp32, at fp32's rate; torch's own bf16 product
    there ran at 10 GFLOP/s (a Zen 3 EPYC, AVX2 only, against 120 widened)."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype in _ONEDNN_DTYPES:
        return weight.dtype
    return torch.float32 if weight.dtype == torch.bfloat16 and torch.float32 in _ONEDNN_DTYPES else None


def _in_panels(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and native.panels_take(weight.dtype)


def _panels_take_any_rows(weight: torch.Tensor) -> bool:
    """Whether every product of this weight's dtype runs in panels (fp32 with AVX-512 and AMX), so none in oneDNN."""
    return _in_panels(weight) and native.most_panel_rows(weight.dtype) == native.ANY_ROWS


def _packed_weights(layers: Sequence[nn.Linear], onednn: bool = False) -> _Packed:
    """The layers' packed forms: the panels where they take the weight's dtype, oneDNN's layout once a product runs
    there (`onednn`). Where the panels take every row count (fp32 with AVX-512 and AMX) none does, and oneDNN's copy
    would be another 0.54 GB for SmolLM2 in fp32."""
    packed = _packed.get(layers[0])
    first = layers[0].weight
    if packed is None or not packed.made_from(layers) or (
            packed.panels is None and _in_panels(first)):  # packed while the native kernels were switched off
        with torch.no_grad():
            weight, bias = _stacked(layers)
            panels = native.Panels.of(weight, bias) if _in_panels(first) else None
        packed = _packed[layers[0]] = _Packed.of(layers, panels, bias)
    if onednn and packed.onednn is None and (dtype := onednn_dtype(first)) is not None:
        with torch.no_grad():
            packed.onednn = torch.ops.mkldnn._reorder_linear_weight(_stacked(layers)[0].to(dtype), PACK_FOR_ROWS)
    return packed


def int8_panels(*layers: nn.Linear) -> native.Panels:
    """The layers' fp32 weights stacked (as `linear` stacks them) in int8 panels (`native.int8_panels`), made once
    and again only once a weight or bias is replaced or changed: what a decoding step of a model decoding in int8
    multiplies (LayerwiseModel.decode_in_int8)."""
    packed = _packed_int8.get(layers[0])
    if packed is None or not packed.made_from(layers):
        with torch.no_grad():
            weight, bias = _stacked(layers)
            panels = native.Panels.of(weight, bias, int8=True)
        packed = _packed_int8[layers[0]] = _Packed.of(layers, panels, bias)
    return packed.panels


def linear_int8(rows: torch.Tensor, *layers: nn.Linear, plus: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` of fp32 rows over the layers' weights in int8 (`int8_panels`)."""
    panels = int8_panels(*layers)
    return native.panel_rows(rows.contiguous(), panels.panels, panels.out_features, panels.bias, plus)


def _stacked(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights stacked into one [sum of out_features, in_features], and their biases likewise."""
    weight = torch.cat([layer.weight for layer in layers]) if len(layers) > 1 else layers[0].weight
    return weight, _stacked_bias(layers)


def _stacked_bias(layers: Sequence[nn.Linear]) -> torch.Tensor | None:
    if all(layer.bias is None for layer in layers):
        return None
    return torch.cat([layer.bias.detach() if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
                      for layer in layers])


def _version(tensor: torch.Tensor | None) -> int | None:
    # Tensors made under inference mode keep no version counter (and a loaded model's weights are not such).
    return None if tensor is None or tensor.is_inference() else tensor._version


def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN packs and multiplies on this CPU: its bf16 path needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT,
    and refuses to pack bf16 weights elsewhere (a Zen 3 EPYC, AVX2 only), where they are widened to fp32."""
    if not onednn_available():
        return ()
    return tuple(d for d in PACKED_DTYPES if d != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())


_ONEDNN_DTYPES = onednn_dtypes()
