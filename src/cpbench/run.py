"""``python -m cpbench.run``: the driver's module entry, for torchrun and for launching from
any directory (an installed cpbench has no ``benchmarks/``). Same flags and tables as
``cpbench run``::

    torchrun --nproc-per-node 8 -m cpbench.run --strategy zigzag --seqlen 128K

Exit status: 0 ok, 1 a strategy failed or a check failed, 2 bad input. Under torchrun the status
is torchrun's (1 when any worker fails); its failure summary names cpbench's line as the root
cause (each rank leaves it in its error file) with the worker's exit code 2.
"""

from __future__ import annotations

import sys

from cpbench.cli import main as cli_main


def main(argv: list[str] | None = None) -> int:
    return cli_main(["run", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
