"""What rank 0 says of a run (the driver's log, ``bench.driver``): the header (the problem,
the topology and the run's estimate, ``bench.eta``), each case's line with its record
appended to ``--out``, and the footer (the summary tables, the outcome, where the records
are)."""

from __future__ import annotations

import logging

from cpbench import results
from cpbench.bench import eta
from cpbench.bench.plan import Plan
from cpbench.reference import Comparison

log = logging.getLogger("cpbench")
out_log = logging.getLogger("cpbench.out")  # results: stdout in every format (report.console)


def say_record(p: Plan, record: dict, prefix: str, seconds: float) -> None:
    """Rank 0: append the record and say how the case went in one line (its detail block
    with --details); a failed check's tensors below it."""
    from cpbench import report

    if p.out:
        results.append(p.out, record)
    log.info("%s: %s", prefix, report.case_line(record, seconds))
    if p.run.format == "table" and p.run.details:
        out_log.info(report.detail(record))
    elif record.get("check") and (p.run.format != "table"
                                  or record["derived"]["check_passed"] is False):
        for c in record["check"]:
            log.info("  %s", Comparison(**c).line())


def header(p: Plan, world: int) -> None:
    from cpbench import report

    topo = p.topo
    log.info("cpbench: %d case(s) on %d ranks (%d node(s) × %d), %s on %s, %s",
             len(p.cases), world, topo.num_nodes, topo.ranks_per_node, p.kernel, p.run.device,
             ", ".join(f"{k}={v}" for k, v in p.attn.to_dict().items()
                       if v is not None))  # what is unset says nothing
    if p.estimates:  # bench.estimate's, made before any rank started
        log.info("%s", eta.total_line(p.estimates))
    if p.packed:  # the documents above are the first packing's
        log.info("%d packings of %s (seeds %d..%d), each strategy on each", len(p.packed),
                 p.documents_spec, p.run.seed, p.run.seed + len(p.packed) - 1)
    if not p.timed:
        log.info("ranks as threads on one %s: each case builds, checks (--check) and runs "
                 "one untimed step; nothing is timed or measured", p.run.device)
    for line in report.skipped_lines(list(p.skipped)):  # a line per reason, not per case
        log.info("%s", line)


def footer(p: Plan, records: list[dict], failed: bool, broken: bool) -> None:
    from cpbench import report
    from cpbench.report.render import fitting, wide_width

    # what `cpbench report --out` prints, by construction: its function, at its width, on
    # the records as the file gives them back (the summary and, for a table, the outcome)
    with fitting(wide_width(p.run.wide)):
        text = report.report([results.as_read(r) for r in records], p.run.format)
    out_log.info(text.rstrip("\n"))
    if p.out:
        log.info("records: %s  (re-render: cpbench report %s)", p.out, p.out)
    if broken:
        log.info("FAILED: a collective failed and the run stopped there (see above)")
    elif failed:
        log.info("FAILED: a strategy raised or a check failed (see above)")
