#!/usr/bin/env python3
"""Submit cpbench cases to Slurm: one case, or a cases file as a job array or one allocation.

    scripts/slurm/submit_sweep.py --nodes 4 --cases cases.txt --array --max-parallel 2 \\
        -- --out results.jsonl
    scripts/slurm/submit_sweep.py --nodes 4 --dry-run -- --strategy all --seqlen 512K \\
        --out r.jsonl

Every case is checked first, as ``cpbench sweep --dry-run`` checks it: on any error nothing is
submitted (exit 2). See ``cpbench.cli.submit_sweep`` (the checks), ``cpbench.slurm`` (the
command lines) and ``cpbench.sbatch`` (what runs on the nodes).
"""

import sys

from cpbench.cli.submit_sweep import main

if __name__ == "__main__":
    sys.exit(main())
