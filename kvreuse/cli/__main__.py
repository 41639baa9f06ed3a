import sys

from kvreuse.cli import main

sys.exit(main())
