"""Rank 0's console: progress lines and results, through ``logging`` (configured once per
process; ``print`` is never rebound). Logger ``cpbench`` carries progress, ``cpbench.out``
the tables. Other ranks stay silent: what they have to say reaches rank 0 as data.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import Callable

from cpbench import ranklocal
from cpbench.report.render import prose, terminal_width

# a plain progress line where the output is no terminal (a log): every 15 s at first, then
# every tenth of the time run so far, at most every 10 min (a step of hours: ~100 lines a day)
LOG_EVERY_S = (15.0, 600.0)
TTY_EVERY_S = 1.0  # the status line's refresh on a terminal


class Progress(logging.Handler):
    """Writes records to ``stream``. On a terminal, records marked ``transient`` overwrite one
    status line; elsewhere (logs, pipes) they are dropped, or printed as a plain line when
    marked ``transient="plain"``."""

    def __init__(self, stream, wrap: bool = False):
        super().__init__()
        self.stream = stream
        self.tty = stream.isatty()
        self.pending = False
        self.wrap = wrap  # progress lines folded to the terminal's width (tables fit already)

    def emit(self, record):
        if self.stream is None:
            return
        try:
            self._write(self.format(record), record)
        except BrokenPipeError:  # e.g. `| head`: stop printing, finish the run and its records
            self.stream = None

    def _write(self, msg, record):
        transient = getattr(record, "transient", False)
        if transient and self.tty:  # one line, or \r no longer returns to its start
            self.stream.write("\r\033[K" + fitted(msg, transient=True))
            self.pending = True
            self.stream.flush()
            return
        if transient is True:
            return
        if self.pending:
            self.stream.write("\r\033[K")
            self.pending = False
        self.stream.write((fitted(msg) if self.wrap else msg) + "\n")
        self.stream.flush()


def fitted(msg: str, transient: bool = False) -> str:
    """``msg`` within the terminal's width: a status line cut to one line (or ``\\r`` no longer
    returns to its start), any other with each line folded at spaces (``render.prose``)."""
    if transient:
        return msg[:terminal_width() - 1]
    return "\n".join(prose(msg.split("\n")))


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
            handler = Progress(stream, wrap=logger is log)
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
    handler = Progress(stream or sys.stderr, wrap=True)
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


def clock(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` for a duration; days as ``3 d 4:05:06``."""
    s = max(0, int(round(seconds)))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 or days else \
        f"{s // 60}:{s % 60:02d}"
    return f"{days} d {text}" if days else text


def _tty(log: logging.Logger) -> bool:
    return any(isinstance(h, Progress) and h.tty and h.stream is not None
               for h in log.handlers)


class Ticker:
    """Progress of long work that says it often enough: ``prefix: text | elapsed 1:02 |
    ~3:04 left``, refreshed every second on a terminal (the status line), a plain line now
    and then elsewhere (``LOG_EVERY_S``), from a thread, so a step of hours still shows its
    clock. ``left()``: seconds still to go, or None (unknown). Silent where the logger
    prints nothing (ranks other than 0). ``with Ticker(...) as t: t.set("warm-up 1")``."""

    def __init__(self, prefix: str, left: Callable[[], float | None] = lambda: None,
                 logger: str = "cpbench"):
        self.prefix, self.left, self.log = prefix, left, logging.getLogger(logger)
        self.text = ""
        self.t0 = self.said = time.monotonic()
        # ranks as threads: only rank 0's ticker (its beats come from a thread of no rank)
        self.on = self.log.isEnabledFor(logging.INFO) and ranklocal.rank() in (None, 0)
        self.tty = _tty(self.log)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        if self.on:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def set(self, text: str) -> None:
        """What is under way now; shown at once on a terminal."""
        self.text = text
        if self.on and self.tty:
            self._say()

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        left = self.left()
        eta = "" if left is None else f" | ~{clock(left)} left"
        return f"{self.prefix}: {self.text} | elapsed {clock(elapsed)}{eta}"

    def _say(self) -> None:
        with self._lock:
            self.said = time.monotonic()
            self.log.info("%s", self.line(), extra={"transient": True if self.tty else "plain"})

    def _beat(self) -> None:
        while not self._stop.wait(TTY_EVERY_S):
            now = time.monotonic()
            every = TTY_EVERY_S if self.tty else min(max(LOG_EVERY_S[0], (now - self.t0) / 10),
                                                     LOG_EVERY_S[1])
            if self.text and now - self.said >= every:
                self._say()
