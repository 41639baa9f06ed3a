"""What every analysis writes: `<name>.json` (the numbers, with the settings that produced them) and
`<name>.png` (the figure)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AnalysisSettings:
    dataset: Path
    limit: int
    model: str | None  # None: the embedded SmolLM2-135M-Instruct
    ratio: float  # the recompute ratio of the fixed-ratio comparisons
    seed: int  # of random selections


def write_outputs(out: Path, name: str, settings: AnalysisSettings, numbers: dict, draw: Callable) -> list[Path]:
    """Save `numbers` as JSON and the figure `draw(figure, numbers)` fills as PNG, under `out`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    document = {"analysis": name, "settings": {k: str(v) for k, v in vars(settings).items()}, **numbers}
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    figure = plt.figure(figsize=(12, 5), layout="constrained")
    draw(figure, numbers)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return [json_path, png_path]
