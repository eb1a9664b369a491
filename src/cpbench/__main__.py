"""``python -m cpbench``: the ``cpbench`` command, for an environment whose scripts directory
is not on PATH."""

import sys

from cpbench.cli import main

sys.exit(main())
