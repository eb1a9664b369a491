"""How fast ``cpbench simulate`` predicts: every strategy and variant × 8 sequence lengths ×
batch 1/2 × bf16/fp16 on 1, 2, 4 and 8 nodes of 8 GPUs, from a cold cache. Prints the count
and the rate (the goal: a thousand configurations in under five seconds on 2 cores).

    python benchmarks/sim_speed.py
"""

import sys
import time

from cpbench.sim import command, hardware, model
from cpbench.topology import Topology


def main() -> int:
    model.clear_cache()
    hw = hardware.load("a800-sxm")
    start, n = time.perf_counter(), 0
    for nodes in (1, 2, 4, 8):
        topo = Topology(world_size=8 * nodes, ranks_per_node=8)
        for dtype in ("bf16", "fp16"):
            for batch in (1, 2):
                attention = dict(batch=batch, heads=40, head_dim=128, dtype=dtype, causal=True)
                records, _ = command.simulate(("all",), {}, attention,
                                              [2 ** k for k in range(15, 23)], topo, hw)
                n += len(records)
    elapsed = time.perf_counter() - start
    sys.stdout.write(f"{n} configurations in {elapsed:.2f} s ({n / elapsed:.0f} per second)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
