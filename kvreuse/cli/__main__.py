import sys

from kvreuse.cli import command

sys.exit(command())
