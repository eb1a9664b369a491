"""The one exception type for bad input."""


class UsageError(ValueError):
    """What the user got wrong, with the fix in the message: the commands print it as one
    line and exit 2. A plain ValueError elsewhere is a bug, and is not reported as bad input."""


class Skipped(UsageError):
    """A strategy that cannot run this problem correctly (a mask it does not take, a dtype its
    library gets wrong): when other strategies of the run can, its row is skipped with this
    reason (one line) and the run goes on; alone, it is bad input like any other."""
