"""Argument types and options shared by several commands."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvreuse.model.options import DECODE_WEIGHTS, DTYPE_NAMES


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR_OR_GGUF",
                        help="local Hugging Face directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")


def add_dtype(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES), help=help)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    add_model(parser)
    add_dtype(parser)
    parser.add_argument("--decode-weights", default="model", choices=DECODE_WEIGHTS,
                        help="the weights decoding multiplies: the model's own (default), or int8 copies of them "
                             "(fp32 models; prompts keep fp32: see docs/RESULTS.md for its fidelity)")


def positive_int(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def whole_number(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


T = TypeVar("T")


def checked_by(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argument type from a library's check of the text: its ValueError is what argparse says of the argument,
    when the command starts (before any model loads)."""

    def parse(text: str) -> T:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def store_spec(text: str) -> str:
    """A --store spec, read (opening nothing) when the command starts: a mistyped one is named before any model
    loads."""
    from kvreuse.store.spec import parse_store_spec  # imports torch: only once a command that stores is given

    checked_by(parse_store_spec)(text)
    return text


def output_folder(text: str) -> Path:
    """A folder a command writes into (made if missing): checked when it starts, so that a file in its place
    does not lose a long run at its end."""
    path = Path(text)
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(existing)!r} is a file, not a folder")
    _check_writable(text, existing)
    return path


def _check_writable(text: str, folder: Path) -> None:
    """os.access: a read-only file system refuses even root, which mode bits do not."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(folder)!r} cannot be written to")


def output_file(text: str) -> Path:
    """A file a command writes at its end: checked when it starts, so that a bad path does not lose a long run."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {str(path.parent)!r} does not exist")
    _check_writable(text, path.parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written to")
    return path
