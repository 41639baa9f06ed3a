"""The command tree, built in one place from each command module's `add_arguments`, and the entry point."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Collection

# Each command: the module (kvreuse.cli.*) that adds its arguments and runs it, and its line in `kvreuse --help`,
# in the order listed there. Only the module of the command given is imported: most import torch and transformers
# (seconds), which `kvreuse --help` and a mistyped command need not wait for.
COMMANDS = {
    "generate": ("generate", "answer a prompt, optionally over reusable documents; print the text and its TTFT"),
    "check-model": ("check_model", "run the correctness gate on a model"),
    "bench": ("bench", "benchmarks"),
    "profile": ("profile", "measure this machine and model for the controller and restoration"),
    "cache": ("cache", "list, inspect, clear and benchmark a KV store"),
    "eval": ("eval", "compare reuse methods with full prefill on a benchmark JSONL file"),
    "analyze": ("analyze", "reproduce a paper's observation on this model (PNG + JSON)"),
    "serve": ("serve", "OpenAI-compatible HTTP server with reusable documents, a context-cache API and metrics"),
}


def build_parser(commands: Collection[str] = tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The command tree; the commands outside `commands` are listed by name and help, without their arguments."""
    parser = argparse.ArgumentParser(prog="kvreuse", description="Reuse KV caches of long prompts.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module, help) in COMMANDS.items():
        command = subparsers.add_parser(name, help=help)
        if name in commands:
            importlib.import_module(f"kvreuse.cli.{module}").add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(commands=argv[:1]).parse_args(argv)  # the command comes first: kvreuse has no options
    # SIGTERM (kill, timeout, a CI job cancelled) unwinds like Ctrl-C: private redis-servers stop, temp folders go
    terminate = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input, a model that cannot be loaded (ModelLoadError is a ValueError)
        print(f"kvreuse: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the command opened has been closed on the way here; no traceback
        print("kvreuse: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        if terminate is not None:
            signal.signal(signal.SIGTERM, terminate)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
