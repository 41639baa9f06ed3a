"""`kvreuse cache ls|stats|rm|clear|bench`: look after a store and measure its tiers.

`add_arguments(cache)` adds the sub-commands to the main CLI's `cache` parser; each sets `func`, which takes the
parsed args and returns an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from typing import Iterator

from rich.console import Console
from rich.table import Table

from kvreuse.cli.arguments import checked_by, output_file, positive_int
from kvreuse.store.base import TierUnavailable
from kvreuse.store.bench import BenchResult, EntryShape, bench_all_tiers, make_entries
from kvreuse.store.entry import DTYPES
from kvreuse.store.keys import check_key
from kvreuse.store.spec import open_store
from kvreuse.store.throttled import DEVICES
from kvreuse.store.tiered import TieredStore

STORE_ENV = "KVREUSE_STORE"


def add_arguments(cache: argparse.ArgumentParser) -> None:
    sub = cache.add_subparsers(dest="cache_command", required=True)
    store_help = f"store spec, tiers top to bottom, e.g. memory:2GB,disk:/var/kv (default: ${STORE_ENV})"

    def command(name: str, func, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        if name != "bench":
            p.add_argument("--store", default=os.environ.get(STORE_ENV), help=store_help)
        p.set_defaults(func=func)
        return p

    command("ls", cmd_ls, "list entries")
    command("stats", cmd_stats, "entries, bytes and capacity of each tier")
    # each key checked before any is deleted: an invalid one among several stopped `rm` half way
    command("rm", cmd_rm, "delete entries by key").add_argument("keys", nargs="+", metavar="KEY",
                                                                type=checked_by(check_key))
    command("clear", cmd_clear, "delete every entry")
    bench = command("bench", cmd_bench, "measure each tier's read/write bandwidth and latency on this machine")
    bench.add_argument("--dir", help="directory for the disk tier (default: a temp dir under /var/tmp)")
    bench.add_argument("--redis", default="auto",
                       help="'auto' starts a private redis-server on loopback; a URL uses that server; 'none' skips")
    bench.add_argument("--entries", type=positive_int, default=24)
    bench.add_argument("--emulate", type=_devices, default="ssd,hdd,net10g",
                       help=f"devices to emulate over memory, from {','.join(DEVICES)} ('' for none)")
    bench.add_argument("--json", type=output_file,
                       help="also write the results to this file (for the restoration controllers)")
    for field in dataclasses.fields(EntryShape):
        checked = {"dtype": {"choices": tuple(DTYPES)}}.get(field.name, {"type": positive_int})
        bench.add_argument(f"--{field.name.replace('_', '-')}", default=field.default, **checked)


def _devices(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in DEVICES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown device {unknown[0]!r}; known: {', '.join(DEVICES)}")
    return names


def _console(stderr: bool = False) -> Console:
    # Piped output (logs, docs) gets wide tables rather than rich's 80-column default.
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=200)


@contextlib.contextmanager
def _opened(args: argparse.Namespace) -> Iterator[TieredStore]:
    # Bad input (ValueError, a missing folder) is named by the CLI's entry point, which exits 2 as for any command.
    if not args.store:
        raise ValueError(f"no store given: pass --store SPEC or set ${STORE_ENV}")
    store = open_store(args.store, create_folders=False)  # a mistyped disk path is refused, not created empty
    try:
        yield store
    except TierUnavailable as e:  # the machine's fault, not the input's: exit 1, worded as the CLI's errors
        raise SystemExit(f"kvreuse: error: {e}") from e
    finally:
        store.close()


def cmd_ls(args: argparse.Namespace) -> int:
    table = Table("key", "tiers", "layers", "tokens", "dtype", "compile mode", "model")
    with _opened(args) as store:
        for key in store.keys():
            meta = store.meta(key)
            if meta is None:
                continue  # damaged or gone since listing: the warning says which
            tiers = ",".join(str(i) for i, t in enumerate(store.tiers) if t.contains(key))
            table.add_row(key, tiers, str(meta.num_layers), str(meta.num_tokens), meta.dtype, meta.compile_mode,
                          meta.model_fingerprint)
    _console().print(table)
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        tiers = store.stats()["tiers"]
    table = Table("tier", "entries", "bytes", "capacity")
    for t in tiers:
        usage = (t.get("entries", "?"), t.get("bytes_used", "?"), t.get("capacity") or "-")
        table.add_row(t["tier"], *map(str, usage))
    _console().print(table)
    unreachable = [t["tier"] for t in tiers if "entries" not in t]
    for tier in unreachable:
        _console(stderr=True).print(f"{tier}: could not be reached: its entries are unknown")
    return 1 if unreachable else 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        missing, unreachable = [], _unavailable(store)
        for key in args.keys:
            if not store.delete(key):
                # "not found" only if every tier answered: a tier that could not be reached may hold the key.
                missing.append((key, _unavailable(store) > unreachable))
                unreachable = _unavailable(store)
    for key, unreachable in missing:
        _console(stderr=True).print(f"not deleted, a tier could not be reached: {key}" if unreachable
                                    else f"not found: {key}")
    return 1 if missing else 0


def _unavailable(store: TieredStore) -> int:
    return sum(tier.get("unavailable", 0) for tier in store.stats()["tiers"])


def cmd_clear(args: argparse.Namespace) -> int:
    with _opened(args) as store:
        _console().print(f"deleted {store.clear()} entries")
        left = sum(1 for _ in store.keys())  # a read-only folder, a tier gone meanwhile
    if left:
        _console(stderr=True).print(f"{left} entries could not be deleted")
    return 1 if left else 0


def cmd_bench(args: argparse.Namespace) -> int:
    shape = EntryShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EntryShape)})
    entries = make_entries(shape, args.entries)
    console = _console()
    # Other work on the machine skews every figure: report the load next to them.
    load = os.getloadavg()[0]
    console.print(f"{args.entries} entries of {entries[0].nbytes / 1e6:.2f} MB ({shape.layers} layers x "
                  f"{shape.tokens} tokens x {shape.heads} heads x {shape.head_dim}, {shape.dtype}); "
                  f"{os.cpu_count()} CPUs, load average {load:.2f} before the run")
    results = bench_all_tiers(entries, args.dir, args.redis, args.emulate)
    console.print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"entry_shape": dataclasses.asdict(shape), "entries": args.entries,
                       "load_average_before": load,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
    return 0


def _table(results: list[BenchResult]) -> Table:
    table = Table("tier", "write GB/s", "read GB/s", "get ms (p50)", "1 layer ms (p50)",
                  "85% rows ms (p50)", "note", title="KV store tiers on this machine")
    for r in results:
        write = "-" if "EMULATED" in r.note else f"{r.write_gbps:.2f}"  # devices emulate reads; writes are memory's
        table.add_row(r.tier, write, f"{r.read_gbps:.2f}", f"{r.get_ms:.2f}", f"{r.layer_ms:.2f}", f"{r.rows_ms:.2f}",
                      r.note)
    return table
