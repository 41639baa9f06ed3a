"""Kernels of our own, in C (native.c), for what torch's CPU kernels do slowly: at decoding's sizes, the product
of a few rows (`panel_rows`, through a weight laid out in panels, bf16 in AMX tiles where the CPU has them;
`few_rows`, through a plain bf16 one) and the attention of one query per sequence (`decode_attention`, over fp32
or bf16 KV); the attention of many queries at any positions (`prefill_attention`: a prefill's rows, or a fusion
plan's selected ones), and on CPUs with AMX-BF16 bf16 queries over keys in position order in the AMX tiles
(`amx_causal_attention`); a layer's pointwise steps in one pass each (`rms_norm`, `silu_mul`, `rope`, fp32 or
bf16), where torch runs several ops; and, where a layer's products run in panels, its input norm with the q/k/v
product (`normed_panel_rows`) and its end (`layer_end`: o-projection, residual, norm, gated MLP) as one call each,
those kernels one after another with no return to Python between them (the checks and allocations around nine
calls a layer were a third of one sequence's decoding step).

The source is compiled on first use with the system's C compiler, `-march=native` (the vector instructions of
the CPU it runs on), and cached under the kvreuse cache folder, keyed by the source, the flags and the CPU, so a
home folder shared by different machines never loads a library built for another CPU. It takes well under a
second. Without a compiler, or with KVREUSE_NATIVE=0, every caller falls back to torch's kernels: the results
are the same within float rounding, only slower.

The library links the OpenMP runtime that torch itself loaded (libgomp.so.1 is resolved once per process), so its
threads are torch's and `torch.get_num_threads()` sets how many it uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from kvreuse.model.allocator import long_lived_empty
from kvreuse.model.identity import cache_root, fingerprint

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: with it, the compiler links crtfastmath.o, which sets flush-to-zero for the whole
# process when the library loads (Python would then read 5e-324 as 0.0).
LINK_FLAGS = ["-shared", "-fopenmp"]
DISABLE_VARIABLE = "KVREUSE_NATIVE"

_POINTER, _INT64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "few_rows": [_POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT],
    "has_bf16_dot": [],
    "has_amx_bf16": [],
    "amx_permitted": [],
    "allow_amx_panels": [_INT],
    "amx_causal_attention": [_POINTER, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT64, _INT64, _INT64,
                             ctypes.c_float, _POINTER, _INT],
    "release_idle_threads": [],
    "panel_width": [],
    "panel_rows_most": [],
    "panel_rows": [_POINTER, _INT64, _INT64, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _POINTER, _INT64, _INT,
                   _INT],
    "decode_attention_parts": [_INT64, _INT64, _INT],
    "decode_attention_scratch": [_INT64, _INT64, _INT64, _INT64, _INT64, _INT],
    "decode_attention": [_POINTER, _POINTER, _POINTER, _INT, _INT64, _INT64, _INT64, _POINTER, _INT64, _POINTER,
                         _POINTER, _INT64, _INT64, _INT64, _INT64, _INT64, _INT64, ctypes.c_float, _POINTER, _POINTER,
                         _INT],
    "prefill_attention": [_POINTER, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _INT64, _POINTER, _INT64, _INT64,
                          _INT64, _INT64, _INT64, ctypes.c_float, _INT64, _POINTER, _POINTER, _INT, _INT],
    "prefill_attention_scratch": [_INT64, _INT64, _INT64, _INT64, _INT64, _INT, _INT],
    "prefill_attention_vector_width": [],
    "rms_norm": [_POINTER, _INT64, _INT64, _INT64, _POINTER, ctypes.c_float, _POINTER, _INT64, _INT, _INT],
    "silu_mul": [_POINTER, _POINTER, _INT64, _INT64, _INT64, _POINTER, _INT, _INT],
    "rope": [_POINTER, _INT64, _INT64, _INT64, _INT64, _POINTER, _POINTER, _INT64, _POINTER, _INT64, _INT, _INT],
    "normed_panel_rows": [_POINTER, _INT64, _INT64, _INT64, _POINTER, ctypes.c_float, _POINTER, _INT64, _POINTER,
                          _POINTER, _POINTER, _INT, _INT],
    "layer_end": [_POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _POINTER, ctypes.c_float, _POINTER,
                  _POINTER, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT, _INT],
    "place_layers": [_INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT64,
                     _INT64, _POINTER, _POINTER, _INT64, _POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT, _INT],
}
_RESULTS = {"has_bf16_dot": _INT, "has_amx_bf16": _INT, "amx_permitted": _INT, "allow_amx_panels": _INT,
            "amx_causal_attention": _INT, "place_layers": _INT, "release_idle_threads": _INT, "panel_width": _INT,
            "panel_rows_most": _INT, "prefill_attention_scratch": _INT64, "prefill_attention_vector_width": _INT,
            "decode_attention_parts": _INT64, "decode_attention_scratch": _INT64}


class NativeBuildError(RuntimeError):
    """The C compiler could not build native.c."""


_switched_off = False  # by `disabled`


def available() -> bool:
    return not _switched_off and library() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Torch's kernels everywhere inside: what `kvreuse bench decode` measures the native kernels against."""
    global _switched_off
    before, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = before


@contextlib.contextmanager
def bf16_panels_in_vectors() -> Iterator[None]:
    """bf16 `panel_rows` in vdpbf16ps inside, even where AMX tiles would take them (`AMX_BF16_PANEL_ROWS`): the
    two kernels checked side by side."""
    lib = library()
    before = lib.allow_amx_panels(0)
    try:
        yield
    finally:
        lib.allow_amx_panels(before)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None when they cannot be (the callers then use torch)."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler found (cc, or $CC): the runtime decodes with torch's kernels")
        return None
    folder = cache_root() / "native"
    try:
        path = build(compiler, folder)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged file in the cache is built again
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(build(compiler, folder)))
    except (NativeBuildError, OSError) as error:
        log.warning("native kernels unavailable, using torch's: %s", error)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = _RESULTS.get(name)
    return lib


def release_idle_threads() -> bool:
    """Free the OpenMP worker threads the calling thread's parallel work left waiting (libgomp keeps a team per
    thread that starts parallel work; torch's ops and these kernels share it). libgomp lets idle workers spin
    for the next parallel region only while it manages no more threads than the machine has CPUs; a second
    thread's team beside the first makes every idle worker sleep, and each parallel region then waits for them
    to wake. The server loads the model on one thread and runs it on its engine thread: on a 2-core Zen 4 one
    int8 product of a decoding step took 104-131 us there against 48-51 on the loading thread, and a decoding
    step of SmolLM2 13-16 ms against 7.3. The loading thread calls this before the engine thread starts; its
    next parallel work, if any, starts a team again. Returns whether the workers were released (False without
    the native library: torch's own kernels then run, at their own pace)."""
    lib = library()
    return lib is not None and lib.release_idle_threads() == 0


def build(compiler: str, folder: Path) -> Path:
    """The shared library of native.c for this CPU, compiled into `folder` unless it is there already. Written
    under a temporary name and renamed, so a process never loads another's half-written file."""
    source = SOURCE.read_bytes()
    target = folder / f"native-{fingerprint(source.hex(), compiler, *COMPILE_FLAGS, *LINK_FLAGS, _cpu_identity())}.so"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        objects, built = Path(scratch) / "native.o", Path(scratch) / "native.so"
        _run(compiler, [*COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(objects)])
        _run(compiler, [*LINK_FLAGS, str(objects), "-o", str(built), "-lm"])
        os.replace(built, target)
    return target


def _run(compiler: str, arguments: list[str]) -> None:
    result = subprocess.run([compiler, *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        raise NativeBuildError(f"{compiler} failed on {SOURCE.name}: {result.stderr.strip()[-2000:]}")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and instruction sets."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


# What the kernels read and write besides fp32: bf16, widened as read, summed in fp32 and rounded as written. On
# CPUs with AVX512-BF16, `prefill_attention` and `panel_rows` of bf16 rows multiply bf16 as it is, in the bf16
# dot-product instruction (exact products, fp32 sums).
FP32_OR_BF16 = (torch.float32, torch.bfloat16)


# The most rows `few_rows` takes (a bf16 layer's where `panel_rows` does not run bf16): from 4 rows on, oneDNN's
# product is as fast.
FEW_ROWS = 3


def few_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [n, out_features] = rows [n, in_features] @ weight.T (+ bias), n <= FEW_ROWS, through a bf16 layer
    (weight, bias and out bf16), the rows (fp32 or bf16) widened and summed in fp32: contiguous CPU tensors (the
    caller checks), but `out` may be columns of a wider output (stacked projections side by side). On CPUs with
    AVX512-BF16 a bf16 layer's rows go through `panel_rows`; fp32 layers' always do."""
    if (not 1 <= rows.shape[0] <= FEW_ROWS or rows.shape[1] != weight.shape[1] or out.stride(-1) != 1
            or out.shape != (rows.shape[0], weight.shape[0]) or (bias is not None and bias.shape != out.shape[1:])):
        raise ValueError(f"few_rows: {tuple(rows.shape)} rows into {tuple(out.shape)} (stride {out.stride()}) "
                         f"over a weight {tuple(weight.shape)}")
    if not _is_bf16("few_rows", weight, out, *([] if bias is None else [bias])):
        raise ValueError("few_rows: takes bf16 layers; an fp32 layer's rows go through panel_rows")
    x = rows.float().contiguous()
    library().few_rows(x.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(), weight.shape[0],
                       pointer(bias), out.data_ptr(), out.stride(0), torch.get_num_threads())


# Where the CPU multiplies bf16 in AMX tiles (`bf16_in_amx`), the most bf16 rows `linear` sends through
# `panel_rows`, which multiplies them in the tiles too once Linux has granted them: SmolLM2's projections of 30
# layers in turn, on a 2-core Xeon with AMX-BF16, took 9.7 / 11.3 / 13.4 ms at 1 / 16 / 32 rows against oneDNN's
# 12.5 / 12.8 / 14.9, level at 64, 32.6 against 25.4 at 128. Without the grant, 4: vdpbf16ps's panels ran at 128
# GFLOP/s and oneDNN at 117 at 4 rows, level at 6, then 180 against 222 at 8 and 205 against 431 at 16.
AMX_BF16_PANEL_ROWS = 32
VECTOR_BF16_PANEL_ROWS = 4
# fp32 with AVX-512: products of any number of rows take the panels (`most_panel_rows`). Past the library's 1024
# the products alone run level with oneDNN's (SmolLM2's projections of 30 layers, alternated, on a 2-core Xeon
# with AMX: 2193 / 2182 ms at 2048 rows, 3974 / 3999 at 4096; 1.01 of oneDNN's at 2048 on a Zen 4 EPYC), but a
# step whose products all take the panels runs as the native calls resolved once (ResolvedStep): a layer's norm and
# q/k/v product in one call, its end (o-projection, residual, norm, MLP) in another, where oneDNN's products leave
# them to torch's ops between. Full prefill on that Xeon took 0.75-0.84x the time at 2K tokens, 0.90-0.93x at 4K.
# On a Zen 4 EPYC (AVX-512, no AMX) the same comparison gave 1.00 at 2K, 1.01 at 3K and 1.03 at 4K (6 rounds
# alternated in one process, docs/RESULTS.md): its products in panels past 2048 rows lose more than the resolved
# calls save, so fp32 takes the panels for any rows only where the CPU has AMX (the Xeons measured).
ANY_ROWS = sys.maxsize
FP32_PANEL_ROWS_WITHOUT_AMX = 2048


def most_panel_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` `linear` sends through `panel_rows` rather than oneDNN, for the library as built:
    fp32 ANY_ROWS with AVX-512 and AMX-BF16, FP32_PANEL_ROWS_WITHOUT_AMX with AVX-512 alone; else 1024 with
    AVX-512, 2048 with AVX2 (its tile in assembly; native.c's `panel_rows_most` gives the measurements), bf16
    AMX_BF16_PANEL_ROWS where the CPU multiplies bf16 in AMX tiles (VECTOR_BF16_PANEL_ROWS if Linux refuses the
    process the tiles); 0 without the library. The reuse methods'
    products of a few hundred rows gain most: naive's question rows, CacheBlend's and CacheTune's recomputed ones
    (docs/RESULTS.md, "Products of up to 1024 rows in panels")."""
    if not available():
        return 0
    built = _built(library())
    if dtype == torch.bfloat16 and built.amx_bf16:
        return min(built.most_rows, AMX_BF16_PANEL_ROWS if _amx_permitted() else VECTOR_BF16_PANEL_ROWS)
    if dtype == torch.float32 and built.avx512:
        return ANY_ROWS if built.amx_bf16 else FP32_PANEL_ROWS_WITHOUT_AMX
    return built.most_rows


def bf16_in_amx() -> bool:
    """Whether this CPU multiplies bf16 in AMX tiles (AMX-BF16, as the library was built): there oneDNN's bf16
    products and torch's fused bf16 attention run several times faster than this library's bf16 kernels, except
    at a few rows (`most_panel_rows`; the attention of one query reads memory and keeps the decoding kernel)."""
    return available() and _built(library()).amx_bf16


def panels_take(dtype: torch.dtype) -> bool:
    """Whether `panels` lays out weights of `dtype`: fp32, and bf16 where the bf16 dot-product kernel is built."""
    return available() and (dtype == torch.float32 or (dtype == torch.bfloat16 and _built(library()).bf16_dot))


@dataclass(frozen=True)
class _Built:
    """What a build of the library was compiled with, asked once (each ctypes call costs about a microsecond, and a
    decoding step runs a product through `panel_rows` about 120 times)."""

    panel_width: int
    bf16_dot: bool
    amx_bf16: bool
    most_rows: int

    @property
    def avx512(self) -> bool:
        return self.panel_width == 32  # a panel is two vectors: of 16 floats with AVX-512, of 8 with AVX2


@functools.cache
def _built(lib: ctypes.CDLL) -> _Built:
    return _Built(lib.panel_width(), bool(lib.has_bf16_dot()), bool(lib.has_amx_bf16()), lib.panel_rows_most())


def panels(weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] laid out for `panel_rows` in panels of w outputs (the library's panel width), the outputs
    past `out` zeros: fp32 as [ceil(out / w), in, w]; bf16 as [ceil(out / w), ceil(in / 2), w, 2], inputs in pairs
    (an odd `in` with a zero column added). In memory kept for weights (`allocator.long_lived_empty`)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or not panels_take(weight.dtype):
        raise ValueError(f"panels: takes an fp32 (or, with AVX512-BF16, bf16) CPU weight [out, in], got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    width, (out_features, in_features) = _built(library()).panel_width, weight.shape
    pair = 2 if weight.dtype == torch.bfloat16 else 1
    padded = torch.nn.functional.pad(weight.detach(), (0, -in_features % pair, 0, -out_features % width))
    laid = padded.view(-1, width, -(-in_features // pair), pair).transpose(1, 2)
    laid = laid if pair == 2 else laid.squeeze(-1)
    return long_lived_empty(laid.shape, laid.dtype).copy_(laid)


def int8_panels(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [out, in] in int8 for `panel_rows`, laid out as `panels` lays fp32 out, each panel's int8
    [in, w] followed by its w outputs' fp32 scales: [ceil(out / w), in * w + 4 * w] bytes (`_int8_rows`)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.float32 or not available():
        raise ValueError(f"int8_panels: takes an fp32 CPU weight [out, in], got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    width, (out_features, in_features) = _built(library()).panel_width, weight.shape
    quantized, scales = _int8_rows(weight.detach())
    quantized = torch.nn.functional.pad(quantized, (0, 0, 0, -out_features % width))
    scales = torch.nn.functional.pad(scales, (0, -out_features % width), value=1.0)
    laid = quantized.view(-1, width, in_features).transpose(1, 2).reshape(-1, in_features * width)
    scales = scales.view(-1, width).contiguous().view(torch.int8)
    return torch.cat([laid, scales], dim=1, out=long_lived_empty((laid.shape[0], laid.shape[1] + scales.shape[1]),
                                                                 torch.int8))


def int8_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] whose products `panel_rows` runs over `int8_panels(weight)`: every weight rounded
    to its output's int8 step, what int8 decoding multiplies (its tests' reference, its fidelity's explanation)."""
    quantized, scales = _int8_rows(weight)
    return quantized.float() * scales[:, None]


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output's row of an fp32 weight [out, in] as int8 and its scale: its largest |weight| / 127, the row
    divided by it and rounded to the nearest integer (symmetric, per output channel: the usual int8 weights of LLM
    inference, whose error per weight is at most half a scale step). An all-zero row gets scale 1."""
    scales = weight.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(weight / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def panel_rows(rows: torch.Tensor, weight_panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
               plus: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] @ weight.T (+ bias [out_features]) (+ plus [n, out_features]: a residual) for a weight given as
    its `panels` (or `int8_panels`): [n, out_features], summed in fp32. All fp32, or fp32 rows over int8 panels
    (each output's sum scaled, then its bias added), or all bf16: then the product plus bias is rounded to bf16
    once, and `plus` added to that, as torch adds a residual to a bf16 layer's output."""
    if not _panel_rows_take(rows, weight_panels, out_features, bias, plus):
        raise ValueError(f"panel_rows: rows {tuple(rows.shape)} {rows.dtype} into {out_features} outputs over panels "
                         f"{tuple(weight_panels.shape)} {weight_panels.dtype}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}, plus "
                         f"{None if plus is None else (tuple(plus.shape), plus.dtype)}: CPU tensors all fp32, or all "
                         f"bf16 with AVX512-BF16 (fp32 rows also over int8 panels), panels as `panels` or "
                         f"`int8_panels` lay them out")
    n, in_features = rows.shape
    depth = in_features if weight_panels.dtype == torch.int8 else weight_panels.shape[1]
    bf16 = rows.dtype == torch.bfloat16
    out = torch.empty(n, out_features, dtype=rows.dtype)
    added = None if plus is None else plus.contiguous()
    # bf16 rows of an odd width get the zero column their panels have
    x = torch.nn.functional.pad(rows, (0, 1)) if bf16 and in_features % 2 else rows.contiguous()
    library().panel_rows(x.data_ptr(), x.shape[1], n, depth, weight_panels.data_ptr(), out_features,
                         pointer(bias), pointer(added), out.data_ptr(), out_features, torch.get_num_threads(),
                         weights_format(weight_panels))
    return out


def _panel_rows_take(rows: torch.Tensor, weight_panels: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                     plus: torch.Tensor | None) -> bool:
    return (rows.dim() == 2 and rows.device.type == "cpu"
            and _panels_fit(rows.shape[1], rows.dtype, weight_panels, out_features, bias)
            and (plus is None or (plus.shape == (rows.shape[0], out_features) and plus.dtype == rows.dtype
                                  and plus.device.type == "cpu")))


def _panels_fit(in_features: int, dtype: torch.dtype, weight_panels: torch.Tensor, out_features: int,
                bias: torch.Tensor | None) -> bool:
    """Whether `panels` laid these panels out for a weight [out_features, in_features] of `dtype` (and `bias` is
    that weight's), or `int8_panels` for an fp32 one."""
    if (weight_panels.device.type != "cpu" or not weight_panels.is_contiguous() or not available()
            or (bias is not None and not (bias.shape == (out_features,) and bias.dtype == dtype
                                          and bias.is_contiguous() and bias.device.type == "cpu"))):
        return False
    width, count = _built(library()).panel_width, -(-out_features // _built(library()).panel_width)
    if weight_panels.dtype == torch.int8:  # each panel's int8 rows, then its fp32 scales
        return dtype == torch.float32 and weight_panels.shape == (count, (in_features + 4) * width)
    bf16 = dtype == torch.bfloat16
    return (weight_panels.dtype == dtype and panels_take(dtype) and weight_panels.dim() == 3 + bf16
            and weight_panels.shape[:3] == (count, (in_features + 1) // 2 if bf16 else in_features, width))


# `format` of native.c's products: the weights' layout in panels
WEIGHTS_FP32, WEIGHTS_BF16, WEIGHTS_INT8 = 0, 1, 2


def weights_format(weight_panels: torch.Tensor) -> int:
    """native.c's `format` for a product over these panels: the rows' dtype, or int8 weights for fp32 rows."""
    if weight_panels.dtype == torch.int8:
        return WEIGHTS_INT8
    return WEIGHTS_BF16 if weight_panels.dtype == torch.bfloat16 else WEIGHTS_FP32


def parts_take(rows: torch.Tensor, *widths: int) -> bool:
    """Whether `normed_panel_rows` and `layer_end` take rows of this dtype whose products have inputs of these
    widths: fp32, or bf16 of even widths (panels hold bf16 in pairs, and these kernels pad none)."""
    return rows.dtype == torch.float32 or all(width % 2 == 0 for width in widths)


@dataclass(frozen=True)
class Panels:
    """A weight [out_features, in_features] laid out by `panels` (or `int8_panels`), with its bias: what the kernels
    that run a layer's parts in one call take. Checked once, as it is made, so that a call checks only its rows."""

    panels: torch.Tensor
    in_features: int
    out_features: int
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not _panels_fit(self.in_features, self.rows_dtype, self.panels, self.out_features, self.bias):
            raise ValueError(f"Panels: {tuple(self.panels.shape)} {self.panels.dtype} panels (bias "
                             f"{None if self.bias is None else tuple(self.bias.shape)}) are not those of a weight "
                             f"[{self.out_features}, {self.in_features}]")

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype of the rows (and bias) multiplied: the weight's own, or fp32 over int8."""
        return torch.float32 if self.panels.dtype == torch.int8 else self.panels.dtype

    @property
    def format(self) -> int:
        return weights_format(self.panels)

    @staticmethod
    def of(weight: torch.Tensor, bias: torch.Tensor | None = None, int8: bool = False) -> Panels:
        """`weight` (and `bias`) laid out by `panels`, or by `int8_panels` if `int8`."""
        return Panels(int8_panels(weight) if int8 else panels(weight), weight.shape[1], weight.shape[0], bias)


def normed_panel_rows(rows: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: Panels) -> torch.Tensor:
    """`panel_rows` of `rms_norm(rows, norm_weight, eps)` in one call, to the bit what the two give: a layer's q/k/v
    product of its normalised input."""
    n, width = rows.shape
    if (not _rows(rows) or rows.device.type != "cpu" or weight.in_features != width or norm_weight.shape != (width,)
            or not norm_weight.is_contiguous() or not rows.dtype == norm_weight.dtype == weight.rows_dtype
            or not parts_take(rows, width)):
        raise ValueError(f"normed_panel_rows: rows {tuple(rows.shape)} {rows.stride()} {rows.dtype}, a norm weight "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}, a weight [{weight.out_features}, "
                         f"{weight.in_features}] {weight.panels.dtype}: rows of the weight's width (bf16: even), "
                         f"one dtype")
    scratch = torch.empty(n * width, dtype=rows.dtype)
    out = torch.empty(n, weight.out_features, dtype=rows.dtype)
    library().normed_panel_rows(rows.data_ptr(), rows.stride(0), n, width, norm_weight.data_ptr(), eps,
                                weight.panels.data_ptr(), weight.out_features, pointer(weight.bias),
                                scratch.data_ptr(), out.data_ptr(), torch.get_num_threads(), weight.format)
    return out


def layer_end(attn: torch.Tensor, residual: torch.Tensor, o_proj: Panels, norm_weight: torch.Tensor, eps: float,
              gate_up: Panels, down: Panels) -> torch.Tensor:
    """The end of a Llama layer for attended rows attn [n, q width] in one call, to the bit what its kernels give one
    after another: h = attn @ o_proj + residual, then h + down(silu(gate) * up) of rms_norm(h), gate and up the
    halves of one product's outputs (`gate_up`)."""
    (n, attn_width), hidden, intermediate, dtype = attn.shape, residual.shape[-1], down.in_features, attn.dtype
    if (not attn.is_contiguous() or not residual.is_contiguous() or residual.shape != (n, hidden)
            or attn.device.type != "cpu" or residual.device.type != "cpu"
            or norm_weight.shape != (hidden,) or not norm_weight.is_contiguous()
            or (o_proj.in_features, o_proj.out_features, gate_up.in_features, gate_up.out_features,
                down.out_features) != (attn_width, hidden, hidden, 2 * intermediate, hidden)
            or not (dtype == residual.dtype == norm_weight.dtype == o_proj.rows_dtype == gate_up.rows_dtype
                    == down.rows_dtype)
            or not o_proj.format == gate_up.format == down.format
            or not parts_take(attn, attn_width, hidden, intermediate)):
        raise ValueError(f"layer_end: rows {tuple(attn.shape)} {dtype} with a residual {tuple(residual.shape)} "
                         f"{residual.dtype} through weights o [{o_proj.out_features}, {o_proj.in_features}], gate/up "
                         f"[{gate_up.out_features}, {gate_up.in_features}] and down [{down.out_features}, "
                         f"{down.in_features}]: contiguous rows, one dtype, o [hidden, q width], gate/up "
                         f"[2 x intermediate, hidden], down [hidden, intermediate] (bf16: even widths)")
    intermediates = layer_end_intermediates(n, hidden, intermediate, dtype)
    out = torch.empty(n, hidden, dtype=dtype)
    library().layer_end(attn.data_ptr(), n, attn_width, residual.data_ptr(), hidden, o_proj.panels.data_ptr(),
                        pointer(o_proj.bias), norm_weight.data_ptr(), eps, gate_up.panels.data_ptr(),
                        pointer(gate_up.bias), intermediate, down.panels.data_ptr(), pointer(down.bias),
                        *(t.data_ptr() for t in intermediates), out.data_ptr(), torch.get_num_threads(),
                        o_proj.format)
    return out


def layer_end_intermediates(n: int, hidden: int, intermediate: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`layer_end`'s working rows: h and norm(h) [n, hidden], the gate/up product [n, 2 x intermediate] (no rows
    where the intermediate width is whole panels, as native.c's layer_end decides: it then takes silu(gate) * up
    from the product's tiles as they come) and the activation [n, intermediate]. Separate buffers, not one: the
    largest stays as small as an MLP pass's gate/up output, below malloc's mmap threshold
    (allocator.MMAP_THRESHOLD), so each comes back from the heap. Joined, a 2K-token prefill's (47 MB for SmolLM2)
    was mapped afresh at every layer: 115-178 thousand page faults a prefill."""
    gate_up_rows = 0 if intermediate % _built(library()).panel_width == 0 else n
    return [torch.empty(rows, width, dtype=dtype)
            for rows, width in ((n, hidden), (n, hidden), (gate_up_rows, 2 * intermediate), (n, intermediate))]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention_runs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these: queries and KV on the CPU, the KV in one of FP32_OR_BF16 (bf16 is
    half the bytes of a step that reads every sequence's KV; the sums are fp32 either way) and the queries in the
    same dtype or fp32, and the library built."""
    return (keys.dtype in FP32_OR_BF16 and q.dtype in (torch.float32, keys.dtype)
            and q.device.type == keys.device.type == "cpu" and available())


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     lengths: torch.Tensor, q_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """One query position per sequence: q [S, Hkv, G, D] (the G query heads sharing each KV head) over keys and
    values [S, Hkv, L, D] (fp32 or bf16, any strides but the last; a pool's slots), where sequence s attends its
    first lengths[s] rows whose positions[s, j] are visible from q_pos[s] (causal, within `window` if given).
    Returns [S, Hkv, G, D] in q's dtype, summed in fp32."""
    seqs, heads, groups, dim = q.shape
    if (keys.shape != values.shape or keys.stride() != values.stride() or keys.stride(-1) != 1
            or keys.dtype != values.dtype or keys.dtype not in FP32_OR_BF16):
        raise ValueError(f"decode_attention: keys and values must share a layout with rows of contiguous heads and "
                         f"a dtype of {FP32_OR_BF16}, got {tuple(keys.shape)} {keys.stride()} {keys.dtype} and "
                         f"{tuple(values.shape)} {values.stride()} {values.dtype}")
    if positions.stride(-1) != 1 or any(t.dtype != torch.long for t in (positions, lengths, q_pos)):
        raise ValueError("decode_attention: positions (with contiguous rows), lengths and query positions must be "
                         "int64")
    longest = max(lengths.tolist(), default=0)  # a list of a few: cheaper than a reduction and its .item()
    if (keys.shape[:2] != (seqs, heads) or keys.shape[-1] != dim or longest > min(keys.shape[2], positions.shape[-1])
            or positions.shape[0] != seqs or lengths.shape != (seqs,) or q_pos.shape != (seqs,)):
        raise ValueError(f"decode_attention: keys {tuple(keys.shape)}, positions {tuple(positions.shape)}, lengths "
                         f"{tuple(lengths.shape)} and query positions {tuple(q_pos.shape)} do not hold {seqs} "
                         f"sequences of {heads} heads of {dim} and up to {longest} rows")
    queries, lengths, q_pos = q.float().contiguous(), lengths.contiguous(), q_pos.contiguous()
    out = torch.empty_like(queries)
    threads = torch.get_num_threads()
    scratch = decode_attention_scratch(seqs, heads, groups, dim, longest, threads)
    seq_stride, head_stride, row_stride, _ = keys.stride()
    library().decode_attention(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.dtype == torch.bfloat16,
                               seq_stride, head_stride, row_stride, positions.data_ptr(), positions.stride(0),
                               lengths.data_ptr(), q_pos.data_ptr(), seqs, heads, groups, dim, longest, window or 0,
                               scale, scratch.data_ptr(), out.data_ptr(), threads)
    return out.to(q.dtype)


def decode_attention_scratch(sequences: int, heads: int, groups: int, dim: int, longest: int,
                             threads: int) -> torch.Tensor:
    """`decode_attention`'s working memory (fp32): each thread's scores, then every part's sums, top scores and
    totals."""
    return torch.empty(library().decode_attention_scratch(sequences, heads, groups, dim, longest, threads))


def decode_attention_parts(tasks: int, longest: int, threads: int) -> int:
    """How many parts `decode_attention` cuts the rows of each of `tasks` tasks (a sequence's KV head, or all its
    heads where its rows hold them side by side) into for `threads` threads: enough that the threads share the work
    evenly (one sequence of 3 KV heads on 2 threads: 2), in parts of no fewer than LEAST_ROWS_A_PART rows
    (native.c) of the `longest` sequence."""
    return library().decode_attention_parts(tasks, longest, threads)


# Query rows of one task of `prefill_attention`: four register tiles of 6 (8 queries of SmolLM2's 3 query heads per
# KV head). Each task reads its KV head's visible keys once, so larger blocks read them fewer times, and waste more
# on keys masked for the block's earlier queries. On a 2-core Zen 4 EPYC, 12 to 36 rows ran 1-4K causal rows within
# the noise of each other; on a Zen 3 (AVX2 only, half the L2), against 12 rows, 24 took 0.89 / 0.95 / 0.97 of the
# time for 1K / 2K / 4K causal rows, 0.93 for a question's 89 rows over 1K keys, 0.98-1.02 for rows scattered over
# the prompt (CacheBlend's); 36 was slower at 4K (1.04). Fewer rows keep a call of a few queries small.
BLOCK_ROWS = 24


def heads_in_rows(t: torch.Tensor) -> bool:
    """Rows [n, heads, dim] whose heads lie side by side (any row stride): how the kernels read q, k and v (views of
    one product) and a request's cache."""
    return t.stride(-1) == 1 and t.stride(1) == t.shape[-1]


# The heads `amx_causal_attention` takes: their sums fill the four tiles left beside the scores' and operands'.
AMX_ATTENTION_DIM = 64


def amx_causal_attention_runs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `amx_causal_attention` takes these (the caller checks the positions): bf16 in AMX tiles (the CPU has
    AMX-BF16 and Linux lets the process use them), heads of AMX_ATTENTION_DIM side by side in rows, keys and values
    laid out alike."""
    return (bf16_in_amx() and _amx_permitted() and q.dtype == keys.dtype == values.dtype == torch.bfloat16
            and q.device.type == "cpu" and q.shape[-1] == AMX_ATTENTION_DIM and keys.shape[-1] == q.shape[-1]
            and heads_in_rows(q) and heads_in_rows(keys) and keys.shape == values.shape
            and keys.stride() == values.stride() and q.shape[1] % keys.shape[1] == 0)


@functools.cache
def _amx_permitted() -> bool:
    """Linux hands a process the AMX tiles' state once it asks (oneDNN asks too); asked once."""
    return library().amx_permitted() == 0


def amx_causal_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """bf16 queries q [n, Hq, 64] at positions q_pos (any of the keys', in any order: a prompt's, a continuation's,
    a fusion plan's recomputed rows) over keys and values [m, Hkv, 64] (rows of contiguous heads at any row stride: a
    request's cache), key row j at position j: causal attention in AMX tiles (native.c), [n, Hq * 64] in bf16. The
    products are exact and summed in fp32; the softmax's weights are rounded to bf16 before the values multiply
    them, and the output once."""
    if not amx_causal_attention_runs(q, keys, values):
        raise ValueError(f"amx_causal_attention: queries {tuple(q.shape)} {q.dtype} over keys {tuple(keys.shape)} "
                         f"{keys.dtype} and values {tuple(values.shape)}: takes bf16 heads of {AMX_ATTENTION_DIM} "
                         f"side by side, keys and values laid out alike, on a CPU with AMX-BF16")
    n, q_heads, dim = q.shape
    m, heads = keys.shape[:2]
    if q_pos.shape != (n,) or q_pos.dtype != torch.long or (n and not 0 <= int(q_pos.min()) <= int(q_pos.max()) < m):
        raise ValueError(f"amx_causal_attention: {n} queries need as many int64 positions of the {m} keys, got "
                         f"{tuple(q_pos.shape)} {q_pos.dtype}")
    q_pos = q_pos.contiguous()
    out = q.new_empty((n, q_heads * dim))
    if n and library().amx_causal_attention(q.data_ptr(), q.stride(0), q_pos.data_ptr(), n, keys.data_ptr(),
                                            values.data_ptr(), keys.stride(0), m, heads, q_heads // heads, scale,
                                            out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"amx_causal_attention: no memory to lay out {m} keys and values of {heads} heads")
    return out


def prefill_attention_takes(dim: int) -> bool:
    """Whether `prefill_attention` runs heads of `dim`: a whole number of the CPU's vectors (64 and 128 are)."""
    return dim % library().prefill_attention_vector_width() == 0


def prefill_attention_runs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes these: one dtype of FP32_OR_BF16 for all three, on the CPU, heads it
    runs, keys and values laid out alike in rows of contiguous heads (a request's own cache; a cache in a pool's
    slot holds each head's rows together), and the library built."""
    return (runs_fp32_or_bf16(q, keys, values) and prefill_attention_takes(q.shape[-1]) and heads_in_rows(keys)
            and keys.shape == values.shape and keys.stride() == values.stride())


def prefill_attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      k_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Queries q [n, Hq, D] of one sequence at positions q_pos over keys and values [m, Hkv, D] (rows of contiguous
    heads at any row stride: a request's cache) at positions k_pos, any order on both sides: a query sees the keys
    at or before its position (and within `window` of it, if given). Returns [n, Hq * D] in their dtype, fp32 or
    bf16 (multiplied as bf16 where the CPU has AVX512-BF16, else widened to fp32)."""
    n, q_heads, dim = q.shape
    m, heads = keys.shape[:2]
    if (keys.shape != values.shape or keys.stride() != values.stride() or not heads_in_rows(keys)
            or keys.shape[-1] != dim or q_heads % heads or not _one_dtype_of_fp32_or_bf16((q, keys, values))):
        raise ValueError(f"prefill_attention: queries {tuple(q.shape)} {q.dtype} over keys {tuple(keys.shape)} "
                         f"{keys.stride()} {keys.dtype} and values {tuple(values.shape)} {values.stride()} "
                         f"{values.dtype}: keys and values must share a layout of contiguous heads of the queries' "
                         f"dim, their heads divide the queries', all one of {FP32_OR_BF16}")
    if q_pos.shape != (n,) or k_pos.shape != (m,) or q_pos.dtype != torch.long or k_pos.dtype != torch.long:
        raise ValueError(f"prefill_attention: {n} queries and {m} keys need as many int64 positions, got "
                         f"{tuple(q_pos.shape)} {q_pos.dtype} and {tuple(k_pos.shape)} {k_pos.dtype}")
    if not prefill_attention_takes(dim):
        raise ValueError(f"prefill_attention: heads of {dim} are not whole vectors of this CPU")
    if not heads_in_rows(q):
        q = q.contiguous()
    q_pos, k_pos = q_pos.contiguous(), k_pos.contiguous()
    groups = q_heads // heads
    block = prefill_attention_block(n, groups)
    threads = torch.get_num_threads()
    lib = library()
    bf16 = q.dtype == torch.bfloat16
    scratch = _scratch(lib.prefill_attention_scratch(m, heads, groups, dim, block, threads, bf16))
    out = q.new_empty((n, q_heads * dim))
    if n:
        lib.prefill_attention(q.data_ptr(), q.stride(0), q_pos.data_ptr(), n, keys.data_ptr(), values.data_ptr(),
                              keys.stride(0), k_pos.data_ptr(), m, heads, groups, dim, window or 0, scale, block,
                              scratch.data_ptr(), out.data_ptr(), threads, bf16)
    return out


def prefill_attention_block(rows: int, groups: int) -> int:
    """Query rows of one task of `prefill_attention` for `rows` queries of `groups` heads a KV head (BLOCK_ROWS):
    a few queries are one block, not padded to a full one."""
    return max(1, min(rows, BLOCK_ROWS // groups))


def _scratch(nbytes: int) -> torch.Tensor:
    """A kernel's working memory, as it comes: the kernels never read what they have not written there."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _rows(t: torch.Tensor) -> bool:
    """Whether a 2-d tensor's rows are contiguous (any row stride)."""
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def _one_dtype_of_fp32_or_bf16(tensors: tuple[torch.Tensor, ...]) -> bool:
    return len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in FP32_OR_BF16


def runs_fp32_or_bf16(*tensors: torch.Tensor) -> bool:
    """Whether the kernels that take fp32 or bf16 (the pointwise ones, `few_rows`) take these tensors: one dtype
    of FP32_OR_BF16, on the CPU, the library built."""
    return _one_dtype_of_fp32_or_bf16(tensors) and all(t.device.type == "cpu" for t in tensors) and available()


def _is_bf16(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether the kernel's tensors are bf16 (else fp32); an error for any other mix."""
    if not _one_dtype_of_fp32_or_bf16(tensors):
        raise ValueError(f"{kernel}: tensors of {sorted({str(t.dtype) for t in tensors})}; all must be one of "
                         f"{FP32_OR_BF16}")
    return tensors[0].dtype == torch.bfloat16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of rows x [n, width] (any row stride): weight * x / sqrt(mean(x^2) + eps). fp32 or bf16 (the
    normalised rows rounded before the weight, as transformers' module does)."""
    if not _rows(x) or weight.shape != x.shape[1:] or not weight.is_contiguous():
        raise ValueError(f"rms_norm: rows {tuple(x.shape)} (strides {x.stride()}) and a weight {tuple(weight.shape)}")
    bf16 = _is_bf16("rms_norm", x, weight)
    out = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(),
                       out.stride(0), torch.get_num_threads(), bf16)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [n, width] of both, which share a row stride (the halves of one product). fp32 or
    bf16 (silu's result rounded before the product, as torch's two ops do)."""
    if not (_rows(gate) and _rows(up)) or gate.shape != up.shape or gate.stride() != up.stride():
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.stride()} and up {tuple(up.shape)} {up.stride()} "
                         f"must be rows of one shape and layout")
    bf16 = _is_bf16("silu_mul", gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    library().silu_mul(gate.data_ptr(), up.data_ptr(), gate.stride(0), gate.shape[0], gate.shape[1], out.data_ptr(),
                       torch.get_num_threads(), bf16)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE of rows x [n, heads, dim] (heads contiguous, any row stride) by cos and sin [n, dim] (the rows' tables,
    any row stride), into `out` (a new tensor, or rows of another one such as a cache's, never x's memory):
    x * cos + rotate_half(x) * sin. fp32 or bf16 (x * cos rounded before the other product is added, as torch's
    ops do)."""
    n, heads, dim = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype)
    if (not heads_in_rows(x) or out.shape != x.shape or not heads_in_rows(out) or cos.shape != (n, dim)
            or sin.shape != (n, dim) or cos.stride() != sin.stride() or not all(_rows(t) for t in (cos, sin))
            or dim % 2 or out.data_ptr() == x.data_ptr()):
        raise ValueError("rope: " + ", ".join(f"{tuple(t.shape)} {t.stride()}" for t in (x, out, cos, sin))
                         + ": rows of contiguous heads of an even dim, tables [n, dim], out apart from x")
    bf16 = _is_bf16("rope", x, cos, sin, out)
    library().rope(x.data_ptr(), x.stride(0), n, heads, dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                   out.data_ptr(), out.stride(0), torch.get_num_threads(), bf16)
    return out


def place_layers(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], cos: Sequence[torch.Tensor],
                 sin: Sequence[torch.Tensor], rows: slice | torch.Tensor, cache_keys: Sequence[torch.Tensor],
                 cache_values: Sequence[torch.Tensor], picks: Sequence[torch.Tensor | None] | None = None) -> None:
    """Stored KV of several layers, in parts, written at `rows` of a cache's layers in one pass: part p's keys
    (before RoPE) and values [layers, rows_p, heads, dim] (each layer contiguous), layer l into cache_keys[l] and
    cache_values[l] [capacity, heads, dim] (rows of contiguous heads; one shape and layout for all). In each layer
    the parts' rows in turn go to `rows` (a slice or int64 indices), keys rotated by the matching rows of that
    layer's tables cos[l] and sin[l] [n, dim] as `rope` turns them, values copied. A part's rows are all of its own
    in order, or picks[p] of them (int64 indices) where given: the rows of a sparse read picked straight from the
    tensors a tier keeps. fp32 or bf16, one dtype for all."""
    picks = [None] * len(keys) if picks is None else list(picks)
    layers = len(cache_keys)
    counts = [k.shape[1] if p is None else p.numel() for k, p in zip(keys, picks)]
    n, (_, heads, dim) = sum(counts), cache_keys[0].shape
    if (len(keys) != len(values) or len(picks) != len(keys) or not layers
            or len(cache_values) != layers or len(cos) != layers or len(sin) != layers
            or any(k.shape != (layers, k.shape[1], heads, dim) or v.shape != k.shape or not _layers_of_rows(k)
                   or not _layers_of_rows(v) for k, v in zip(keys, values))
            or any(p is not None and (p.dtype != torch.long or p.dim() != 1 or not p.is_contiguous()) for p in picks)
            or any(t.shape != cache_keys[0].shape or t.stride() != cache_keys[0].stride()
                   for t in (*cache_keys, *cache_values))
            or not heads_in_rows(cache_keys[0])
            or any(c.shape != (n, dim) or s.shape != (n, dim) or c.stride() != cos[0].stride()
                   or s.stride() != cos[0].stride() for c, s in zip(cos, sin))
            or not _rows(cos[0]) or dim % 2):
        raise ValueError(f"place_layers: parts {[tuple(k.shape) for k in keys]} and {[tuple(v.shape) for v in values]} "
                         f"picking {[None if p is None else (p.dtype, tuple(p.shape)) for p in picks]} into "
                         f"{layers} cache layers {tuple(cache_keys[0].shape)} with tables {tuple(cos[0].shape)}: "
                         "parts of contiguous layers of the cache's heads, picks as 1-d int64, a layer's tables "
                         "[n, dim] for their n rows")
    bf16 = _is_bf16("place_layers", *keys, *values, *cos, *sin, *cache_keys, *cache_values)
    capacity = cache_keys[0].shape[0]
    if isinstance(rows, slice):
        # the rows torch's indexing takes (a negative start counts from the end): the kernel writes from `first` on
        first, stop, step = rows.indices(capacity)
        to = None
        if len(range(first, stop, step)) != n or step != 1:
            raise ValueError(f"place_layers: {n} rows into cache rows {rows}")
    else:
        to, first = rows.to(torch.long).contiguous(), 0
        if to.shape != (n,) or (n and (int(to.min()) < 0 or int(to.max()) >= capacity)):
            raise ValueError(f"place_layers: {n} rows into cache rows {tuple(to.shape)} of {capacity}")
    parts, sizes = ctypes.c_void_p * len(keys), ctypes.c_int64 * len(keys)
    per_layer = ctypes.c_void_p * layers
    picked = None if all(p is None for p in picks) else parts(*(None if p is None else p.data_ptr() for p in picks))
    if library().place_layers(layers, len(keys), parts(*(k.data_ptr() for k in keys)),
                              parts(*(v.data_ptr() for v in values)), sizes(*(k.stride(0) for k in keys)),
                              sizes(*(v.stride(0) for v in values)), sizes(*counts), picked,
                              sizes(*(k.shape[1] for k in keys)), heads, dim,
                              per_layer(*(c.data_ptr() for c in cos)), per_layer(*(s.data_ptr() for s in sin)),
                              cos[0].stride(0), None if to is None else to.data_ptr(), first,
                              per_layer(*(k.data_ptr() for k in cache_keys)),
                              per_layer(*(v.data_ptr() for v in cache_values)), cache_keys[0].stride(0),
                              torch.get_num_threads(), bf16):
        raise ValueError(f"place_layers: picks outside their parts' rows {[k.shape[1] for k in keys]}")


def _layers_of_rows(t: torch.Tensor) -> bool:
    """[layers, rows, heads, dim] with each layer's rows contiguous (layers any distance apart)."""
    return t[0].is_contiguous()
