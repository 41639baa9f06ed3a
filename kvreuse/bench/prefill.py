"""Full-prefill time of our layer-wise runtime against the `transformers` forward, side by side in one run."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

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
            rows.append(dict(tokens=length, **{name: s.median for name, s in samples.items()}))

    table = Table(title=f"Full prefill, {loaded.name}, fp32, {torch.get_num_threads()} threads, median of {repeats}")
    for column in ("tokens", "kvreuse (s)", "transformers (s)", "ratio", "transformers, last logits only (s)", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["tokens"]),
            f"{row['kvreuse']:.3f}",
            f"{row['transformers']:.3f}",
            f"{row['kvreuse'] / row['transformers']:.2f}",
            f"{row['transformers_last_logits']:.3f}",
            f"{row['kvreuse'] / row['transformers_last_logits']:.2f}",
        )
    Console().print(table)
    print("ratio = kvreuse time / transformers time (below 1.0: kvreuse is faster)")
    return rows
