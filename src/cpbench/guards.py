"""Physics guards: what a row of ``cpbench run`` cannot honestly say, as flags on the row.

A flag keeps the row in every table (its text beside it) and in the record
(``derived.flags``), and keeps it from winning ``report --best``; the exit status stays.

- TFLOP/s per device above the device's dense peak for the dtype ("impossible: above
  peak"): known GPUs by name (``PEAKS``, datasheet figures; the simulator's presets carry the
  same bf16 peaks, a test holds them equal); other devices, CPUs included, have no guard,
  and the summary says so once per device (``unguarded``);
- the bytes each rank sent in the timed step against the strategy's declared schedule (the
  record's ``comm`` section): a strategy that silently stopped communicating (CP off) sends
  less than its schedule says;
- a world or CP size other than asked (the record's ``sizes``): every rank in a world of the
  ``--nproc`` asked, a CP row's ring over all of them, its ranks' shards covering the
  sequence once per problem (a rank holding all of it is CP silently off);
- figures that contradict each other (``contradictions``): a time at or below zero, FWD above
  FWD+BWD, a backward faster than its forward though it does 2.5× the FLOPs (beyond the
  interval of their per-iteration ratio), a fraction of ideal above 1; and, from the report's
  join with its baseline, a CP efficiency above what its balance allows (``efficiency_flag``).
  A figure above its bound beyond its 95 % interval is impossible; above it within its
  interval, too noisy to quote: both flagged;
- a cold median (``cold``): no warm-up step ran and fewer than 3 steps were timed, so the
  median holds the first step's one-off costs (allocations, kernel selection, first
  connections);
- an unsettled warm-up (``unsettled``): the warm-up ran its most steps without settling and
  the timed steps were still falling beyond noise (their first half's median over their
  second half's, its interval wholly above 1.10), so the median holds warming steps.

Apart from the flags, ``not_measured``: why a row's timings, honest as clock readings, do not
measure CP (ranks as threads on one device, ranks sharing cores, a machine others kept busy).
Such a row keeps its times with the reason beside them, never wins, and has no CP efficiency
or fraction of ideal printed.

One rule for every printer (``withhold``): a flagged row, or one that does not measure CP,
keeps its times and memory (facts of the machine) and withholds its figures derived as CP
performance (``CP_FIGURES``: TFLOP/s, fraction of ideal, CP efficiency, the slowest rank);
``results.derive`` moves them under ``derived.withheld``, so every table, line, plot and
file prints "-" where the row's note says why, and no flag quotes a figure it withholds.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from cpbench import metrics

# Dense tensor-core TFLOP/s per device, datasheet (no sparsity), by a name fragment of
# torch.cuda.get_device_name, most specific first. fp32 is the TF32 figure: a kernel may use
# TF32 where torch allows it, so that is the most an fp32 row can honestly reach. A family
# holds its fastest variant's figures (an H100 PCIe is held to the SXM's): the guard may miss
# a slower variant's impossible row, never flag a possible one.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # Blackwell (glennklockwood.com/garden/processors/B200 tabulates NVIDIA's figures): a
    # GB200's B200 at 1200 W, an HGX B200 at 1000 W; GB200 first, its name holds "B200"
    ("GB200", {"bf16": 2500.0, "fp16": 2500.0, "fp32": 1250.0}),
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("H800", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    ("MI300X", {"bf16": 1307.4, "fp16": 1307.4, "fp32": 653.7}),
)


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """The dense peak of ``device_name`` in ``dtype``; None for a device not in ``PEAKS``."""
    for fragment, peaks in PEAKS:
        if device_name and fragment.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def _measured(record: dict[str, Any]) -> bool:
    return not (record.get("env") or {}).get("simulated")  # a prediction is no measurement


def peak_flags(record: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """"impossible: above peak" where a measured phase's TFLOP/s per device exceeds it (BWD
    only where it was timed on its own, not an old record's difference of medians). The flag
    quotes the phase's time and the least the peak allows, never the rate it withholds."""
    if not _measured(record):
        return []
    dtype = record["config"]["attention"].get("dtype")
    peak = peak_tflops((record.get("env") or {}).get("device_name"), dtype)
    if peak is None:
        return []
    found = []
    for phase, rate, ms in (("FWD", "fwd_tflops", "fwd_ms"), ("BWD", "bwd_tflops", "bwd_ms"),
                            ("FWD+BWD", "fwd_bwd_tflops", "fwd_bwd_ms")):
        if derived.get(rate) is not None and derived[rate] > peak:
            least = derived[ms] * derived[rate] / peak  # the time at the device's peak
            found.append(f"impossible: above peak ({phase} {derived[ms]:.3g} ms, under the "
                         f"{least:.3g} ms its {peak:g} TFLOP/s {dtype} dense peak allows)")
    return found


def unguarded(records: list[dict[str, Any]]) -> list[str]:
    """The measured devices with no known peak, each once: their rows have no peak guard."""
    names = {(r.get("env") or {}).get("device_name") or (r.get("env") or {}).get("device")
             for r in records if _measured(r) and r.get("samples_ms")}
    return sorted(n for n in names if n and peak_tflops(n, "bf16") is None)


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def comm_flags(comm: dict[str, Any] | None) -> list[str]:
    """"sent X, schedule says Y" for the first rank and step whose bytes differ from the
    schedule's; a step whose timed iterations sent different amounts is flagged too."""
    if not comm:
        return []
    flags = []
    sent, varies = comm["sent_bytes"], comm.get("varies") or {}
    for phase in sent:
        if any(varies.get(phase) or ()):
            flags.append(f"{phase.upper().replace('_', '+')}: bytes sent differ between "
                         f"timed steps")
    declared = comm.get("schedule_bytes")
    if not declared:
        return flags
    for phase, parts in (("fwd", ("fwd",)), ("fwd_bwd", ("fwd", "bwd"))):
        for rank, got in enumerate(sent.get(phase) or []):
            want = sum(declared[p][rank] for p in parts)
            if got is not None and got != want:
                flags.append(f"{phase.upper().replace('_', '+')} rank {rank}: sent "
                             f"{_size(got)}, schedule says {_size(want)}")
                break
    return flags


def size_flags(record: dict[str, Any]) -> list[str]:
    """Where the ranks ran other than the row was asked to (see the module docstring)."""
    sizes = record.get("sizes")
    if not sizes:
        return []
    world, rpp = record["topology"]["world_size"], record["ranks_per_problem"]
    found = []
    if any(w != world for w in sizes["world"]):
        found.append(f"ran in a world of {max(sizes['world'], key=lambda w: w != world)} "
                     f"ranks, asked for {world}")
    wrong_cp = [c for c in sizes["cp"] if c != (world if rpp > 1 else 1)]
    if wrong_cp:
        found.append(f"CP over {wrong_cp[0]} ranks, asked for {world if rpp > 1 else 1}")
    seqlen = record["config"]["attention"]["seqlen"]
    tokens, problems = sum(sizes["local_seqlen"]), world // max(rpp, 1)
    if tokens != seqlen * problems:
        found.append(f"the shards hold {tokens} tokens, the {problems} problem(s) "
                     f"{seqlen * problems}")
    return found


# -- figures that contradict each other -------------------------------------------------------

def _beyond(value: float, bound: float, interval: tuple[float, float] | None, what: str,
            above: bool = True) -> str | None:
    """A flag when ``value`` is past ``bound`` (above, or below with ``above=False``): its
    interval wholly past it, impossible; else too noisy to quote. ``what`` says it in
    figures the row keeps (times): the flag quotes no figure it withholds."""
    past = value > bound if above else value < bound
    if not past:
        return None
    if interval is None:
        return f"{what}: impossible"
    wholly = interval[0] > bound if above else interval[1] < bound
    return (f"{what}, its 95 % interval wholly past it: impossible" if wholly else
            f"{what}, within its 95 % interval: too noisy to quote")


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _iterations(record: dict[str, Any], phase: str) -> list[float] | None:
    samples = (record.get("samples_ms") or {}).get(phase)
    return metrics.slowest_per_iter(samples) if samples else None


def contradictions(record: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """The row's figures against each other (see the module docstring)."""
    if not _measured(record):
        return []
    found = [f"impossible: {name} {derived[key]:.2f} ms is not a time"
             for name, key in (("FWD", "fwd_ms"), ("BWD", "bwd_ms"), ("FWD+BWD", "fwd_bwd_ms"))
             if derived.get(key) is not None and derived[key] <= 0]
    fwd, both, bwd = derived.get("fwd_ms"), derived.get("fwd_bwd_ms"), derived.get("bwd_ms")
    if fwd is not None and both is not None and fwd > both:
        found.append(f"impossible: FWD {fwd:.2f} ms above FWD+BWD {both:.2f} ms")
    fwd_i, bwd_i = _iterations(record, "fwd"), _iterations(record, "bwd")
    if fwd and bwd and fwd > 0 and bwd > 0 and fwd_i and bwd_i and bwd < fwd:
        interval = metrics.bootstrap_ratio(bwd_i, fwd_i)
        if interval[1] < 1:  # noise explains a backward merely level with its forward
            a = record["config"]["attention"]  # 2.5x at one head dim; MLA's V width moves it
            ratio = metrics.pair_flops(a["head_dim"], a.get("v_head_dim"), "bwd") / \
                metrics.pair_flops(a["head_dim"], a.get("v_head_dim"))
            found.append(f"impossible: BWD {bwd:.2f} ms below FWD {fwd:.2f} ms though it "
                         f"does {ratio:.3g}x the FLOPs (ratio's interval "
                         f"[{interval[0]:.2f}, {interval[1]:.2f}])")
    found += _ideal_flags(record, derived)
    return found


def _ideal_flags(record: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """A fraction of ideal above 1: the step beat its ideal (``cpbench.ideal``)."""
    ideal = record.get("ideal") or {}
    fraction = derived.get("fraction_of_ideal")
    if fraction is None or ideal.get("fwd_ms") is None:
        return []
    phase = "fwd_bwd" if derived.get("fwd_bwd_ms") is not None else "fwd"
    steps = _iterations(record, phase)
    ideal_ms = ideal["fwd_ms"] + ((ideal.get("bwd_ms") or 0) if phase == "fwd_bwd" else 0)
    interval = metrics.bootstrap_ratio([ideal_ms], steps) if steps and ideal_ms > 0 else None
    flag = _beyond(fraction, 1.0, interval,
                   f"fraction of ideal above 100 % ({phase.upper().replace('_', '+')} "
                   f"{derived[phase + '_ms']:.2f} ms, faster than its ideal, the kernel alone "
                   f"on its share: {ideal_ms:.2f} ms)")
    return [flag] if flag else []


def efficiency_flag(efficiency: float, interval: tuple[float, float] | None,
                    imbalance: float | None, times: tuple[str, float, float, int]) -> str | None:
    """A CP efficiency above what the row's balance allows: 1 / imbalance (the slowest rank
    computes ``imbalance`` × the mean share; 100 % when balanced). ``times``: (phase, the
    row's time, its baseline's, N), the figures the flag quotes in place of the efficiency."""
    bound = 1.0 / imbalance if imbalance and imbalance > 1 else 1.0
    phase, t_cp, t_base, n = times
    least = t_base / (n * bound)  # the time at that efficiency
    what = (f"CP efficiency above {_pct(bound)} ({phase} {t_cp:.2f} ms, under the "
            f"{least:.2f} ms that the baseline's {t_base:.2f} ms over {n} ranks allows"
            + (f" at imbalance {imbalance:.2f})" if bound < 1 else ")"))
    return _beyond(efficiency, bound, interval, what)


# -- timings that do not measure CP ----------------------------------------------------------

# others may keep this share of the cores busy beyond what our ranks leave free (the
# self-check's default load limit)
BUSY_SHARE = 0.10


def shared_cores(hostnames: Sequence[str], cpus: int) -> str | None:
    """"N ranks share M cores" where a host runs more ranks than its usable cores."""
    if not hostnames or not cpus:
        return None
    most = max(hostnames.count(h) for h in set(hostnames))
    if most <= cpus:
        return None
    return f"{most} ranks share {cpus} core{'s' if cpus > 1 else ''}"


def busy(load: dict[str, Any] | None) -> str | None:
    """"others kept X of N cores busy" when other processes took cores the ranks needed
    (``load``: the record's section, ``bench.load`` on rank 0's host while it timed)."""
    if not load or not load.get("cpus") or not load.get("wall_s"):
        return None
    cpus = load["cpus"]
    others = load["foreign_cpu_s"] / load["wall_s"]
    free = max(0.0, cpus - load.get("ranks_cores", cpus))
    if others <= free + BUSY_SHARE * cpus:
        return None
    return f"others kept {others:.1f} of {cpus} cores busy"


THREADS = "ranks are threads sharing one device: nothing timed or measured"


def not_measured(record: dict[str, Any]) -> str | None:
    """Why this row's timings do not measure CP, or None: ranks as threads sharing one
    device, more ranks than a host's usable cores, or a machine others kept busy while it
    timed (see the module docstring)."""
    env = record.get("env") or {}
    if not _measured(record) or env.get("kernel_bench"):
        return None
    if env.get("launcher") == "threads":
        return THREADS
    reasons = [r for r in (shared_cores(env.get("hostnames") or [], env.get("cpus_usable") or 0),
                           busy(record.get("load"))) if r]
    return f"{'; '.join(reasons)}: timings do not measure CP" if reasons else None


def cold(record: dict[str, Any]) -> list[str]:
    """A median the first, cold step can move: no warm-up, and under 3 timed steps (from 3 on
    the median sets one slow step aside)."""
    timing = record.get("timing")
    if not _measured(record) or not timing or timing["warmup"] or not record.get("samples_ms"):
        return []
    iters = (record["config"].get("run") or {}).get("iters")
    if iters is None or iters >= 3:
        return []
    return [f"cold: no warm-up, and the median of {iters} step{'s' * (iters > 1)} holds the "
            f"first one's one-off costs (--warmup 1 or more)"]


# an unsettled warm-up is flagged only where the timed steps show it: their first half's
# median above their second half's by more than the settle rule's tolerance (10 %), the
# ratio's 95 % interval wholly past it. "settled" alone (its last 3 warm-up steps within
# 10 %) was False for 95 of 157 rows of a 2-core machine's runs, their timed steps level
# within noise; this rule flagged 3 of them, each a case whose timed steps fell 14-115 %.
UNSETTLED_DROP = 0.10
UNSETTLED_LEAST = 4  # timed steps: under 4, a half is one step and noise can't be told apart


def unsettled(record: dict[str, Any]) -> list[str]:
    """A warm-up that ran its most steps without settling, whose timed steps were still
    falling (see ``UNSETTLED_DROP``): the median holds steps still warming up."""
    timing = record.get("timing")
    if not _measured(record) or not timing or timing.get("settled", True) \
            or not timing.get("warmup"):
        return []
    samples = record.get("samples_ms") or {}
    phase = "fwd_bwd" if samples.get("fwd_bwd") else "fwd"
    steps = _iterations(record, phase)
    if not steps or len(steps) < UNSETTLED_LEAST:
        return []
    half = len(steps) // 2
    low, _ = metrics.bootstrap_ratio(steps[:half], steps[half:])
    if low <= 1 + UNSETTLED_DROP:
        return []
    first, last = statistics.median(steps[:half]), statistics.median(steps[half:])
    return [f"unsettled: {timing['warmup']} warm-up steps, timed {phase.upper().replace('_', '+')}"
            f" still fell {first:.2f} to {last:.2f} ms (first {half}, last {len(steps) - half})"]


def flags(record: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """Every flag of a record, given its derived figures (old records without the measured
    sections: only what their figures show)."""
    return (peak_flags(record, derived) + contradictions(record, derived)
            + comm_flags(record.get("comm")) + size_flags(record) + cold(record)
            + unsettled(record))


# -- the one rule every printer applies ------------------------------------------------------

# the figures derived as CP performance: none of them is quoted for a flagged row or one whose
# timings do not measure CP (times and memory are facts of the machine: they stay)
CP_FIGURES = ("fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "fraction_of_ideal",
              "fraction_of_ideal_fwd", "slowest_rank_fwd", "slowest_rank_fwd_bwd",
              "cp_efficiency", "cp_efficiency_low", "cp_efficiency_high")


def withheld_reason(derived: dict[str, Any]) -> str | None:
    """Why a row's CP figures are withheld: its flags, or why it does not measure CP."""
    reasons = [*(derived.get("flags") or ()), *filter(None, [derived.get("not_measured")])]
    return "; ".join(reasons) or None


def withhold(derived: dict[str, Any]) -> dict[str, Any]:
    """``derived`` with its CP figures (``CP_FIGURES``) moved under ``withheld`` where the
    row is flagged or does not measure CP: a reader of the record sees them marked, and
    every printer reads None ("-")."""
    if not withheld_reason(derived):
        return derived
    out = dict(derived)
    kept = {k: out.pop(k) for k in CP_FIGURES if out.get(k) is not None}
    if kept:
        out["withheld"] = kept
    return out
