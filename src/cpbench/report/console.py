"""Rank 0's console: progress lines and results, through ``logging`` (configured once per
process; ``print`` is never rebound). Logger ``cpbench`` carries progress, ``cpbench.out``
the tables. Other ranks stay silent: what they have to say reaches rank 0 as data.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from cpbench import ranklocal


class Progress(logging.Handler):
    """Writes records to ``stream``. On a terminal, records marked ``transient`` overwrite one
    status line; elsewhere (logs, pipes) they are dropped, or printed as a plain line when
    marked ``transient="plain"``."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream
        self.tty = stream.isatty()
        self.pending = False

    def emit(self, record):
        if self.stream is None:
            return
        try:
            self._write(self.format(record), record)
        except BrokenPipeError:  # e.g. `| head`: stop printing, finish the run and its records
            self.stream = None

    def _write(self, msg, record):
        transient = getattr(record, "transient", False)
        if transient and self.tty:
            self.stream.write("\r\033[K" + msg)
            self.pending = True
            self.stream.flush()
            return
        if transient is True:
            return
        if self.pending:
            self.stream.write("\r\033[K")
            self.pending = False
        self.stream.write(msg + "\n")
        self.stream.flush()


def _rank_zero(record: logging.LogRecord) -> bool:
    """Ranks as threads share the process's logging: only rank 0's thread (or a thread of no
    rank, the launcher's) speaks."""
    return ranklocal.rank() in (None, 0)


def setup(rank: int, fmt: str) -> None:
    """Configure logging once per process: rank 0 speaks, other ranks stay quiet. Results go
    to stdout; progress too for the table formats, to stderr for csv/json (parseable stdout).
    Ranks as threads (``ranklocal``): rank 0's thread configures it, the others leave it,
    and a filter keeps their records out."""
    if ranklocal.rank() not in (None, 0):
        return
    log, out_log = logging.getLogger("cpbench"), logging.getLogger("cpbench.out")
    for logger, stream in ((log, sys.stdout if fmt in ("table", "markdown") else sys.stderr),
                           (out_log, sys.stdout)):
        logger.handlers.clear()
        logger.propagate = False
        if rank == 0:
            handler = Progress(stream)
            handler.setFormatter(logging.Formatter("%(message)s"))
            handler.addFilter(_rank_zero)
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        else:
            logger.setLevel(logging.CRITICAL + 1)


@contextlib.contextmanager
def transient_progress(stream=None):
    """Within the block, records of logger ``cpbench`` go to ``stream`` (default stderr):
    those marked transient as one status line on a terminal and nowhere else, the others as
    lines; logging is as it was afterwards (for commands that run in the caller's process,
    e.g. ``simulate``)."""
    log = logging.getLogger("cpbench")
    handler = Progress(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = log.level
    log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        end_status()
        log.removeHandler(handler)
        log.setLevel(level)


def end_status() -> None:
    """Erase a status line still showing, before results are printed below it."""
    for handler in logging.getLogger("cpbench").handlers:
        if isinstance(handler, Progress) and handler.pending and handler.stream is not None:
            handler.stream.write("\r\033[K")
            handler.stream.flush()
            handler.pending = False
