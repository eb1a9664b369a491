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
- figures that are not measurements at all (``not_measured``: ranks as threads on one
  device), shown as "-" with the reason;
- a world or CP size other than asked (the record's ``sizes``): every rank in a world of the
  ``--nproc`` asked, a CP row's ring over all of them, its ranks' shards covering the
  sequence once per problem (a rank holding all of it is CP silently off).
"""

from __future__ import annotations

from typing import Any

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
    """"impossible: above peak" where a measured phase's TFLOP/s per device exceeds it. BWD
    is a difference of two medians (FWD+BWD − FWD), noisy by construction: not judged."""
    if not _measured(record):
        return []
    dtype = record["config"]["attention"].get("dtype")
    peak = peak_tflops((record.get("env") or {}).get("device_name"), dtype)
    if peak is None:
        return []
    return [f"impossible: above peak ({phase} {rate:.0f} TFLOP/s per device > {peak:g} "
            f"{dtype} dense)" for phase, rate in (("FWD", derived.get("fwd_tflops")),
                                                  ("FWD+BWD", derived.get("fwd_bwd_tflops")))
            if rate is not None and rate > peak]


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


THREADS = "ranks are threads sharing one device: times and memory are not measured"


def not_measured(record: dict[str, Any]) -> str | None:
    """Why the row's times and memory (and all figures from them: TFLOP/s, efficiency,
    fraction of ideal) are not measurements of CP, or None. The tables show "-" there and
    this reason among the row's flags. Ranks as threads (``--launcher threads``) share one
    device, its allocator and its cores: a run there checks, it does not measure."""
    if (record.get("env") or {}).get("launcher") == "threads":
        return THREADS
    return None


def flags(record: dict[str, Any], derived: dict[str, Any]) -> list[str]:
    """Every flag of a record, given its derived figures (old records without the measured
    sections: only what their figures show)."""
    reason = not_measured(record)
    return ([reason] if reason else []) + peak_flags(record, derived) + \
        comm_flags(record.get("comm")) + size_flags(record)
