"""The command tree, built in one place from each command group's `add_commands`, and the entry point."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvreuse.cli import analyze, bench, cache, check_model, eval, generate, profile, serve
from kvreuse.model.adapters import UnsupportedModelError
from kvreuse.model.loader import ModelLoadError

# In the order `kvreuse --help` lists them.
COMMAND_GROUPS = [generate, check_model, bench, profile, cache, eval, analyze, serve]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvreuse", description="Reuse KV caches of long prompts.")
    commands = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (kill, timeout, a CI job cancelled) unwinds like Ctrl-C: private redis-servers stop, temp folders go
    terminate = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except (ModelLoadError, UnsupportedModelError, ValueError, OSError) as e:
        print(f"kvreuse: error: {e}", file=sys.stderr)
        return 2
    finally:
        if terminate is not None:
            signal.signal(signal.SIGTERM, terminate)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)

