"""`kvreuse bench restore` and `kvreuse profile l-delta`: registered on the main CLI by `add_commands`."""

from __future__ import annotations

import argparse

from kvreuse.restore.scheduler import IO_PRIORITY_CHOICES
from kvreuse.restore.units import DEFAULT_COMPUTE_RUN
from kvreuse.store.keys import DEFAULT_BLOCK_SIZE

TIER_CHOICES = ["memory", "disk", "ssd", "hdd", "net10g"]


def _add_common(parser: argparse.ArgumentParser, lengths: list[int], repeats: int) -> None:
    parser.add_argument("--layers", type=int, default=2,
                        help="use the embedded SmolLM2's first N layers (real per-layer cost, shorter runs); 0: all")
    parser.add_argument("--tiers", nargs="+", choices=TIER_CHOICES, default=TIER_CHOICES)
    parser.add_argument("--lengths", type=int, nargs="+", default=lengths, help="stored prefix lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK_SIZE, help="prefix block size (tokens)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 leaves the other core of a 2-core machine to the I/O side)")
    parser.add_argument("--compute-run", type=int, default=DEFAULT_COMPUTE_RUN,
                        help="tokens' worth of work the compute side claims at a time")


def cmd_bench_restore(args: argparse.Namespace) -> int:
    from kvreuse.bench.restore import run

    run(args.layers or None, args.tiers, [] if args.batch_only else args.lengths, args.repeats, args.block,
        args.threads, args.compute_run, [t for t in args.batch_tiers if t != "none"], args.batch_lengths,
        args.batch_compute_workers, args.batch_io, args.batch_repeats, args.json)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from kvreuse.bench.restore import run_profile

    run_profile(args.layers or None, args.tiers, args.lengths, args.repeats, args.block, args.threads,
                args.compute_run)
    return 0


def add_commands(profiles: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    bench = benches.add_parser("restore", help="prefix restoration: load, compute, Cake, CacheFlow, per tier")
    _add_common(bench, [512, 1024, 2048, 4096, 8192], 3)
    bench.add_argument("--batch-only", action="store_true", help="run only the batch experiment")
    bench.add_argument("--batch-tiers", nargs="+", default=["hdd", "ssd", "memory"],
                       choices=TIER_CHOICES + ["none"], help="tiers of the batch experiment ('none' skips it)")
    bench.add_argument("--batch-lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    bench.add_argument("--batch-compute-workers", type=int, nargs="+", default=[1, 2],
                       help="compute workers of the batch-aware scheduler to measure, each running batched steps "
                            "over its share of the batch (1: the other core is the I/O side's; 2: one per core of "
                            "this 2-core CPU; per-request Cake: one per request)")
    bench.add_argument("--batch-io", nargs="+", choices=list(IO_PRIORITY_CHOICES), default=list(IO_PRIORITY_CHOICES),
                       help="I/O priorities of the batch-aware scheduler to measure (most-work is CacheFlow's; "
                            "auto, the default, takes it or least-work by the tier's measured rates)")
    bench.add_argument("--batch-repeats", type=int, default=5, help="batches per variant")
    bench.add_argument("--json", help="also write the figures to this file")
    bench.set_defaults(func=cmd_bench_restore)

    prof = profiles.add_parser("l-delta", help="CacheFlow's L_delta (layer-wise vs token-wise restoration) per tier")
    _add_common(prof, [256, 512, 1024, 2048], 3)
    prof.set_defaults(func=cmd_profile)
