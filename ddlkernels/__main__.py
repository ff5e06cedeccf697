"""``python -m ddlkernels``: the command line (ddlkernels/tools/cli.py)."""

import sys

from .tools.cli import main

sys.exit(main())
