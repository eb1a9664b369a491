"""torchrun entry of the cpbench driver: the same flags and tables as ``cpbench run``.

One node, 8 GPUs:
    torchrun --nproc-per-node 8 benchmarks/run.py --strategy zigzag --seqlen 128K
    torchrun --nproc-per-node 8 -m cpbench.run --strategy zigzag --seqlen 128K  # installed

Four nodes (run on each; c10d rendezvous on the first):
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $HEAD:29500 --rdzv-id $JOB benchmarks/run.py --strategy all \\
        --seqlen 512K --out results.jsonl

On CPU (gloo), e.g. 4 local ranks:
    torchrun --standalone --nproc-per-node 4 benchmarks/run.py --strategy zigzag --seqlen 8k --check

Every rank validates the request before the process group exists; rank 0 prints. Exit
status: 0 ok, 1 a strategy failed or a check failed, 2 bad input. Under torchrun the status
is torchrun's (1 when any worker fails); its failure summary names cpbench's line as the root
cause (each rank leaves it in its error file) with the worker's exit code 2.
"""

import sys

from cpbench.run import main

if __name__ == "__main__":
    sys.exit(main())
