"""The `kvreuse` command: argument parsing for every layer, in one package.

`parser.py` builds the command tree; each module registers one command group (`add_commands`) and holds its
handlers, which call into the library.
"""

from kvreuse.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
