"""``python -m cpbench.cli``: the ``cpbench`` command."""

import sys

from cpbench.cli import main

sys.exit(main())
