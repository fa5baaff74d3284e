"""What a user's mistake is, and how it reads: one line that names the bad value, what is valid and the fix.

The command line prints such an error as `error: <line>` and exits 2 (`cli.entry`); the Python API
(`ghostdistill.repair`, ...) raises it as one exception type, `GhostdistillError`. Both classify by
`USER_ERRORS`: the exception types the checks raise for bad input (anything else is a bug and keeps its
traceback).
"""

from __future__ import annotations


class NoSpaceError(OSError):
    """A write failed because the disk is full (or the user's quota spent): one line naming the disk, what
    could not be written and, where known, the space it needed (raised by `core.io`)."""


USER_ERRORS = (
    NoSpaceError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ImportError,
    RuntimeError,
)


class GhostdistillError(ValueError):
    """A user mistake reported by the Python API: the command line's one-line message. A ValueError, so code
    that catches ValueError keeps working. `original`: the exception the check raised (None when the API's own
    check raised this one); it is not chained, so that a notebook shows the one line, not the library's frames."""

    original: BaseException | None = None


def one_line(err: BaseException) -> str:
    """The error's message on one line (its type's name when it has none)."""
    return " ".join(str(err).split()) or type(err).__name__
