"""`kvreuse analyze NAME`: reproduce one of the papers' observations on a model and a benchmark file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvreuse.cli.arguments import add_model, output_folder, positive_int


@dataclass(frozen=True)
class Analysis:
    module: str  # under kvreuse.eval.analyses; imported only when run, since it pulls in torch
    measure: str  # function(probes, settings) -> numbers
    draw: str  # function(figure, numbers)
    methods: tuple[str, ...]  # methods it runs, so their chunks are compiled in every mode they need
    help: str
    reads: tuple[str, ...] = ()  # the settings it uses beyond the dataset's: "ratio", "seed"
    limit: int = 4  # examples by default
    fewest: int = 1  # examples all its figures need


DEFAULT_RATIO, DEFAULT_SEED = 0.15, 0
ANALYSES = {
    "hkvd": Analysis("deviation", "hkvd", "draw_hkvd", ("cacheblend:0.15",),
                     "CacheBlend Fig. 6: deviation vs recompute ratio, HKVD vs random vs gradual filtering",
                     ("seed",)),
    "layer-correlation": Analysis("deviation", "layer_correlation", "draw_layer_correlation", (),
                                  "CacheBlend Fig. 8: Spearman of per-token KV deviation between neighbouring layers",
                                  ("ratio",)),
    "spectrum": Analysis("spectrum", "spectrum", "draw_spectrum", (),
                         "CacheTune Fig. 2: share of K/V energy in the lowest 20%% of frequencies, per layer"),
    "frequency-selection": Analysis("spectrum", "frequency_selection", "draw_frequency_selection", ("cachetune:0.15",),
                                    "CacheTune Fig. 10: low- vs high-frequency vs random selection, and variants",
                                    ("ratio", "seed")),
    "sinks": Analysis("sinks", "chunk_sinks", "draw_chunk_sinks",
                      ("legolink0", "legolink:2", "cacheblend:0.15", "cachetune:0.15"),
                      "Epic Fig. 4: attention on chunk-initial tokens, naive vs full vs LegoLink"),
    "fidelity-signal": Analysis("guard", "fidelity_signal", "draw_fidelity_signal", ("cacheblend:0.15",),
                                "layer-1 KV deviation vs first-token KL per request; guarded:d speed vs bound",
                                limit=20, fewest=6),  # its rank correlations take 3 held-out examples at least
}


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1), got {text!r}")
    return value


def add_arguments(analyze: argparse.ArgumentParser) -> None:
    names = analyze.add_subparsers(dest="analysis", required=True, metavar="NAME")
    for name, analysis in ANALYSES.items():
        sub = names.add_parser(name, help=analysis.help)
        add = sub.add_argument
        add("--dataset", required=True, type=Path, metavar="PATH", help="normalised JSONL file, one chunk per passage")
        add("--limit", type=positive_int, default=analysis.limit, metavar="N",
            help=f"the first N examples (default {analysis.limit})")
        add("--out", type=output_folder, default="docs/img", metavar="DIR", help="where NAME.png and NAME.json go")
        add_model(sub)
        if "ratio" in analysis.reads:
            add("--ratio", type=_share, default=DEFAULT_RATIO, metavar="R",
                help=f"recompute ratio of fixed-ratio comparisons (default {DEFAULT_RATIO})")
        if "seed" in analysis.reads:
            add("--seed", type=int, default=DEFAULT_SEED, help="seed of random selections (default 0)")
        sub.set_defaults(func=cmd_analyze)


def _probes(engine, prompts, methods: tuple[str, ...]) -> Iterator:
    """One example at a time, so only one example's caches and attention maps are alive."""
    from kvreuse.eval.analyses.probe import ExampleProbe

    for i, prompt in enumerate(prompts, 1):
        print(f"example {i}/{len(prompts)}: {prompt.id}", file=sys.stderr)
        yield ExampleProbe(engine, prompt, methods)


def cmd_analyze(args: argparse.Namespace) -> int:
    import importlib

    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.eval.analyses.output import AnalysisSettings, write_outputs
    from kvreuse.eval.datasets import load_dataset

    analysis = ANALYSES[args.analysis]
    dataset = load_dataset(args.dataset, limit=args.limit)  # before the model loads: a bad path fails at once
    if len(dataset.prompts) < analysis.fewest:
        print(f"kvreuse: warning: {args.analysis} on {len(dataset.prompts)} example(s): its figures need "
              f"{analysis.fewest}; those it cannot compute are left empty (null)", file=sys.stderr)
    module = importlib.import_module(f"kvreuse.eval.analyses.{analysis.module}")
    measure: Callable = getattr(module, analysis.measure)
    settings = AnalysisSettings(args.dataset, args.limit, args.model, getattr(args, "ratio", DEFAULT_RATIO),
                                getattr(args, "seed", DEFAULT_SEED))
    engine = ReuseEngine.load(model=args.model, store="memory:8GB")
    try:
        numbers = measure(_probes(engine, dataset.prompts, analysis.methods), settings)
    finally:
        engine.close()
    paths = write_outputs(args.out, args.analysis, settings, numbers, getattr(module, analysis.draw))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
