"""Write an evaluation's results: results.json (everything), results.md (the table), quality_vs_ttft.png.

The plot has the shape of Epic's Fig. 6 / CacheBlend's Fig. 12: one point per method, quality against TTFT,
so the trade-off between fidelity to full prefill and speed reads off at a glance.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from kvreuse.eval.runner import MethodResult, MethodSummary, RunSettings
from kvreuse.fusion.methods import DEFAULT_MAX_KL

SCORE_NAMES = {"qa": "F1", "summary": "Rouge-L"}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown_table(summaries: list[MethodSummary], task: str, floor: float = DEFAULT_MAX_KL) -> str:
    header = (
        f"| method | n | {SCORE_NAMES[task]} | agreement with full | first-token KL (nats) | KL > {floor:g} "
        "| gold log-lik | recompute share | TTFT mean / median / p90 (ms) | speedup vs full: mean, of medians |"
    )
    rows = [header, "|" + "---|" * header.count(" |")]
    for s in summaries:
        ttft = " / ".join(f"{t * 1000:.1f}" for t in (s.ttft_mean, s.ttft_median, s.ttft_p90))
        rows.append(
            f"| {s.method} | {s.examples} | {_fmt(s.score)} | {_fmt(s.agreement)} | {_fmt(s.first_token_kl)} "
            f"| {s.above_floor:.0%} | {_fmt(s.gold_loglik)} | {_fmt(s.recompute_share, 2)} | {ttft} "
            f"| {s.speedup_mean:.2f}x, {s.speedup:.2f}x |"
        )
    return "\n".join(rows) + "\n"


MARKERS = "osD^vP*X"


def _styles(methods: list[str]) -> list[dict]:
    """One colour per method family and one marker per setting within it (cacheblend:0.05 and :0.15 share
    a colour), so a family's settings read as a curve."""
    families = [m.split(":")[0] for m in methods]
    order = list(dict.fromkeys(families))
    return [
        {"color": f"C{order.index(f) % 10}", "marker": MARKERS[families[:i].count(f) % len(MARKERS)]}
        for i, f in enumerate(families)
    ]


def plot(summaries: list[MethodSummary], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt

    panels = [
        ("agreement", "agreement with full prefill (token F1, higher is better)"),
        ("first_token_kl", "first-token KL from full prefill (nats, lower is better)"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4), layout="constrained")
    for ax, (field, label) in zip(axes, panels):
        # a legend, not labels beside the points: methods often land on the same spot
        for s, style in zip(summaries, _styles([s.method for s in summaries])):
            ax.scatter(s.ttft_median * 1000, getattr(s, field), s=60, label=s.method, zorder=3, **style)
        ax.set_xlabel("median TTFT (ms)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=min(len(summaries), 5))
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    """What the TTFT figures were measured on: CPU timings on a busy machine say little, so say how busy."""
    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()}


def _title(settings: RunSettings, summaries: list[MethodSummary]) -> str:
    examples = summaries[0].examples if summaries else 0
    return f"{settings.dataset}: {examples} examples, store {settings.store}, chunking {settings.chunking}"


def _heading(settings: RunSettings, summaries: list[MethodSummary], host: dict) -> str:
    load = ", ".join(f"{x:.1f}" for x in host["load_average"])
    return (
        f"# {_title(settings, summaries)}\n\nmodel {settings.model}, greedy, at most {settings.max_tokens} new "
        f"tokens; {host['cpus']} CPUs, load average {load} (1, 5, 15 min) when written\n\n"
    )


def write_report(
    out_dir: Path, settings: RunSettings, task: str, summaries: list[MethodSummary], results: list[MethodResult],
    floor: float = DEFAULT_MAX_KL,
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "quality_vs_ttft.png"]
    host = machine()
    document = {
        "settings": asdict(settings),
        "machine": host,
        "task": task,
        "score": SCORE_NAMES[task],
        "floor": floor,
        "methods": [asdict(s) for s in summaries],
        "examples": [asdict(r) for r in results],
    }
    paths[0].write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(_heading(settings, summaries, host) + markdown_table(summaries, task, floor), encoding="utf-8")
    plot(summaries, _title(settings, summaries), paths[2])
    return paths
