"""The `kvreuse` command: argument parsing for every layer, in one package.

`parser.py` builds the command tree; each module adds one command's arguments (`add_arguments`) and holds its
handlers, which call into the library. Nothing here imports them (nor torch) before they are needed: the
executable (`command`) first starts itself again with its heap in huge pages where that pays
(kvreuse.model.huge_pages).
"""

from __future__ import annotations

import argparse

from kvreuse.model.huge_pages import exec_with_huge_page_heap


def command() -> int:
    """The `kvreuse` executable and `python -m kvreuse.cli`: `main` on the process's own arguments, once the
    process has restarted itself with its heap in huge pages (a program calling `main` is never restarted)."""
    exec_with_huge_page_heap()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (None: the process's arguments)."""
    from kvreuse.cli.parser import main as run

    return run(argv)


def build_parser() -> argparse.ArgumentParser:
    from kvreuse.cli.parser import build_parser as build

    return build()


__all__ = ["build_parser", "command", "main"]
