"""Full-prefill time of our layer-wise runtime against the `transformers` forward, side by side in one run, and
against this machine's floor for the same prefill (kvreuse.bench.machine): achieved / limit."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from kvreuse.bench.machine import measure, prefill_flops, weight_bytes
from kvreuse.bench.timing import interleaved_samples
from kvreuse.model.loader import load_model


def run(model: str | None, lengths: list[int], repeats: int) -> list[dict]:
    loaded = load_model(model, "float32")
    runtime, hf_model = loaded.runtime, loaded.runtime.hf_model
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in lengths:
        ids = torch.randint(100, hf_model.config.vocab_size, (length,), generator=generator)
        variants = {
            "kvreuse": lambda: runtime.prefill(ids),
            "transformers": lambda: hf_model(ids[None], use_cache=True),
            "transformers_last_logits": lambda: hf_model(ids[None], use_cache=True, logits_to_keep=1),
        }
        with torch.inference_mode():
            samples = interleaved_samples(variants, repeats)
        limit = measure(runtime, rows=length)
        floor = limit.floor_seconds(prefill_flops(runtime, length), weight_bytes(runtime))
        rows.append(dict(tokens=length, **{name: s.median for name, s in samples.items()}, floor=floor,
                         gflops=limit.dense_flops_per_second / 1e9, gbps=limit.bytes_per_second / 1e9))

    table = Table(title=f"Full prefill, {loaded.name}, fp32, {torch.get_num_threads()} threads, median of {repeats}")
    for column in ("tokens", "kvreuse (s)", "transformers (s)", "ratio", "transformers, last logits only (s)", "ratio",
                   "matmul GFLOP/s", "floor (s)", "kvreuse achieved / limit", "transformers achieved / limit"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["tokens"]),
            f"{row['kvreuse']:.3f}",
            f"{row['transformers']:.3f}",
            f"{row['kvreuse'] / row['transformers']:.2f}",
            f"{row['transformers_last_logits']:.3f}",
            f"{row['kvreuse'] / row['transformers_last_logits']:.2f}",
            f"{row['gflops']:.0f}",
            f"{row['floor']:.3f}",
            f"{row['floor'] / row['kvreuse']:.2f}",
            f"{row['floor'] / row['transformers']:.2f}",
        )
    Console(width=200).print(table)
    print("ratio = kvreuse time / transformers time (below 1.0: kvreuse is faster)")
    print("floor = the prefill's FLOPs at the best rate one layer's matmuls reach at that many rows on this machine "
          f"(or its weights read once at {rows[-1]['gbps']:.1f} GB/s); achieved / limit = floor / time")
    return rows
