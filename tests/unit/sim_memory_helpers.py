"""The simulator's memory model against the dry run, case by case (shared by the CPU test
and the fake-CUDA one under masks)."""

from cpbench.bench import dryrun
from cpbench.bench.plan import expand_cases
from cpbench.errors import Skipped, UsageError
from cpbench.sim import model

OWN = ("ring", "zigzag", "megatron-cp", "megatron-cp-a2a+p2p", "double-ring", "burst",
       "ulysses", "usp", "llama3", "local")


def model_errors(attn, topo, *, kernel: str, device: str, names=OWN) -> tuple[int, list[str]]:
    """(cases compared, those whose estimate is more than 10 % off the worst distinct rank's
    dry-run peak), over every strategy of ``names`` (default: every own one) and variant that
    takes ``attn`` on ``topo``."""
    compared, off = 0, []
    for case in expand_cases(names, {}, topo):
        try:
            estimate = model.memory_estimate(case.strategy, case.options, attn, topo,
                                             kernel_buffers=device == "cuda")
        except (UsageError, Skipped):  # a case this problem cannot run: not a finding
            continue
        ranks = dryrun.distinct_ranks(case.strategy, case.options, attn, topo,
                                      kernel_name=kernel)
        done = [dryrun.dry_rank(case.strategy, case.options, attn, topo, r,
                                kernel_name=kernel, device=device) for r in ranks]
        failed = [r for r in done if r.peak_fwd_bwd_bytes is None]
        assert not failed, f"{case.label}: rank {failed[0].rank} {failed[0].status}: " \
                           f"{failed[0].error}"  # its reason, not max() over None
        peak = max(r.peak_fwd_bwd_bytes for r in done)
        compared += 1
        if abs(estimate / peak - 1) > 0.10:
            off.append(f"{case.label}: model {estimate / peak - 1:+.0%}")
    return compared, off
