#!/usr/bin/env python3
"""Submit cpbench cases to Slurm: one case, or a cases file as a job array or one allocation.

    scripts/slurm/submit_sweep.py --nodes 4 --cases cases.txt --array --max-parallel 2 \\
        -- --out results.jsonl
    scripts/slurm/submit_sweep.py --nodes 4 --dry-run -- --strategy all --seqlen 512K

See ``cpbench.slurm`` (the command lines) and ``cpbench.sbatch`` (what runs on the nodes).
"""

import sys

from cpbench.slurm import main

if __name__ == "__main__":
    sys.exit(main())
