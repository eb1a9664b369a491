"""The one exception type for bad input."""


class UsageError(ValueError):
    """What the user got wrong, with the fix in the message: the commands print it as one
    line and exit 2. A plain ValueError elsewhere is a bug, and is not reported as bad input."""
