"""`kvreuse eval`: run reuse methods side by side on a benchmark file and write results, table and plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvreuse.cli.arguments import add_model, output_folder, positive_float, positive_int, store_spec

DEFAULT_METHODS = "full,naive,prefix,cacheblend:0.15,cacheblend:0.05,legolink:2,legolink:16,legolink0,cachetune:0.15"


def add_arguments(ev: argparse.ArgumentParser) -> None:
    add = ev.add_argument
    add("--dataset", required=True, type=Path, metavar="PATH", help="normalised JSONL file (QA, SAMSum, Multi-News)")
    add("--methods", default=DEFAULT_METHODS, metavar="LIST",
        help="comma-separated; full always runs, first, in float32; METHOD@bfloat16 runs METHOD in bf16 against it")
    add_model(ev)
    add("--limit", type=positive_int, default=None, metavar="N", help="the first N examples only")
    add("--chunking", default="passage", metavar="passage|fixed:N", help="one chunk per passage, or N-token pieces")
    add("--store", type=store_spec, default=None, metavar="SPEC",
        help="KV store, e.g. memory:4GB or disk:PATH (default: the engine's)")
    add("--out", type=output_folder, default="eval-results", metavar="DIR", help="output directory and resume cache")
    add("--max-tokens", type=positive_int, default=None, metavar="N", help="default 32 QA, 128 SAMSum, 512 Multi-News")
    add("--floor", type=positive_float, default=None, metavar="KL",
        help="first-token KL an example may reach; the table gives the share above it (default: auto's, 0.15)")
    add("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_eval)


def check_out_holds(out: Path, dataset: str) -> None:
    """An --out folder holds one dataset's report: another dataset's would replace it without a word."""
    try:
        earlier = json.loads((out / "results.json").read_text())["settings"]["dataset"]
    except (OSError, ValueError, KeyError, TypeError):  # no report yet (or not one this command wrote)
        return
    if earlier != dataset:
        raise ValueError(f"--out: {out} holds the report of dataset {earlier!r}; give dataset {dataset!r} a folder "
                         "of its own")


def cmd_eval(args: argparse.Namespace) -> int:
    from kvreuse.eval.datasets import Chunking, load_dataset
    from kvreuse.eval.report import markdown_table, write_report
    from kvreuse.eval.runner import (ResultCache, RunSettings, aggregate, engine_options, parse_methods, run,
                                     runs_missing_chunks, split_dtype)
    from kvreuse.fusion.methods import DEFAULT_MAX_KL

    # Everything the user typed is checked before the model loads, so a typo fails in a second, not a minute.
    methods = parse_methods(args.methods)
    chunking = Chunking.parse(args.chunking)
    dataset = load_dataset(args.dataset, limit=args.limit)
    check_out_holds(args.out, dataset.name)

    from kvreuse.engine.reuse import ReuseEngine
    from kvreuse.store.spec import DEFAULT_STORE

    store = args.store or DEFAULT_STORE
    engine = ReuseEngine.load(model=args.model, store=store)
    dtypes = sorted({dtype for m in methods if (dtype := split_dtype(m)[1]) is not None})
    engines = {dtype: ReuseEngine.load(model=args.model, store=store, **engine_options(dtype)) for dtype in dtypes}
    try:
        if chunking.size is not None:  # cutting into N-token pieces needs the model's tokenizer
            dataset = load_dataset(args.dataset, chunking, engine.tokenizer, args.limit)
        settings = RunSettings(
            model=engine.fingerprint,
            dataset=dataset.name,
            chunking=args.chunking,
            max_tokens=args.max_tokens or dataset.max_tokens,
            store=store,
        )
        cache = ResultCache(args.out / "examples.jsonl")
        results = run(engine, dataset, methods, settings, cache, progress=not args.no_progress, engines=engines)
    finally:
        for opened in [engine, *engines.values()]:
            opened.close()
    floor = args.floor if args.floor is not None else DEFAULT_MAX_KL
    short = runs_missing_chunks(results)
    if short:
        print(f"warning: {len(short)} of {len(results)} runs found fewer of their chunks in the store than were "
              f"compiled (e.g. {short[0].example_id}, {short[0].method}: {short[0].stats['chunk_hits']} of "
              f"{short[0].stats['chunks']}): the store {store} is too small for one example; those runs recomputed "
              "the missing chunks", file=sys.stderr)
    summaries = aggregate(results, methods, floor)
    paths = write_report(args.out, settings, dataset.task, summaries, results, floor)
    print(markdown_table(summaries, dataset.task, floor), end="")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
