"""Physics guards: what a row of ``cpbench run`` cannot honestly say, as flags on the row.

A flag keeps the row in every table (its text beside it) and in the record
(``derived.flags``), and keeps it from winning ``report --best``; the exit status stays.

- the bytes each rank sent in the timed step against the strategy's declared schedule (the
  record's ``comm`` section): a strategy that silently stopped communicating (CP off) sends
  less than its schedule says.
"""

from __future__ import annotations


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


def comm_flags(comm: dict | None) -> list[str]:
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


def flags(record: dict) -> list[str]:
    """Every flag of a record (old records without the measured sections: none)."""
    return comm_flags(record.get("comm"))
