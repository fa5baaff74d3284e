"""The one policy for lists the user gives (views, formats, GGUF types, depths, criteria, students, tasks,
adapted modules, recovery names, layers): a list that names the same thing twice is refused, before any work,
with one line naming what is repeated. Never silently dropped: a repeated view or type is most often a typo
for another one, and writing a file twice (the second write replacing the first without `--overwrite`) or
running a depth twice costs time and hides the mistake.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def repeated(values: Iterable) -> list:
    """The values that occur more than once in `values`, in order of first occurrence."""
    values = list(values)
    counts = Counter((type(v), v) for v in values)  # `True` is not `1`: a bool among integers is its own mistake
    return list(dict.fromkeys(v for v in values if counts[type(v), v] > 1))


def check_unique(what: str, values: Iterable) -> list:
    """`values` as a list, or a ValueError naming `what` and the repeated entries."""
    values = list(values)
    twice = repeated(values)
    if twice:
        raise ValueError(f"{what} {values} names {twice} more than once; name each once")
    return values


def check_names(what: str, given: Iterable[str], valid: Iterable[str]) -> list[str]:
    """`given` as a list when it is a non-empty list of `valid` names, each once; else a one-line error naming
    the bad ones (or the repeated ones) and the valid ones."""
    given, valid = list(given), list(valid)
    bad = [g for g in given if g not in valid]
    if bad or not given:
        raise ValueError(f"{what} {bad or given} is not one of {valid}")
    return check_unique(f"{what}s", given)
