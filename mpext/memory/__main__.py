"""``python -m mpext.memory``: the calculator's command line (mpext.memory.cli)."""
import sys

from .cli import main

sys.exit(main())
