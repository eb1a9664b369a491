"""The one exception type for bad input, and the "did you mean" its messages offer."""

from __future__ import annotations

import difflib
from typing import Callable, Iterable


class UsageError(ValueError):
    """What the user got wrong, with the fix in the message: the commands print it as one
    line and exit 2. A plain ValueError elsewhere is a bug, and is not reported as bad input.
    ``more``: continuation lines where one line cannot hold the fix (the refusal of a run
    over ``--max-minutes`` and its commands); ``str()`` is the first line alone."""

    def __init__(self, message: str = "", *more: str) -> None:
        super().__init__(message)
        self.more = more


class Skipped(UsageError):
    """A strategy that cannot run this problem correctly (a mask it does not take, a dtype its
    library gets wrong): when other strategies of the run can, its row is skipped with this
    reason (one line) and the run goes on; alone, it is bad input like any other."""


def near_miss(given: str, known: Iterable[str]) -> str | None:
    """What ``given`` was likely meant to be among ``known``: the only name it starts (an
    abbreviation), else the closest by spelling (difflib), else None."""
    known = list(dict.fromkeys(known))
    starts = [k for k in known if k.startswith(given) and k != given]
    if len(starts) == 1 and given.strip("-"):
        return starts[0]
    close = difflib.get_close_matches(given, known, n=1)
    return close[0] if close else None


def unknown(what: str, given: str, known: Iterable[str], lister: str) -> str:
    """"unknown {what} 'x' (did you mean y?); use a, b, c", the names listed where the
    bad-input line (120 columns, after its "cpbench COMMAND: error: ") has room for them,
    else where they are listed (``lister``)."""
    known = list(known)
    head = f"unknown {what} {given!r}{did_you_mean(given, known, str)}"
    names = f"{head}; use {', '.join(known)}"
    return names if len(names) <= 95 else f"{head}; {lister} lists them"


def did_you_mean(given: str, known: Iterable[str], quote: Callable[[str], str] = repr) -> str:
    """`` (did you mean 'x'?)`` for a near miss of ``given`` among ``known``, else ``""``."""
    near = near_miss(given, known)
    return f" (did you mean {quote(near)}?)" if near else ""
