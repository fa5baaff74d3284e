"""`compare` and `frontier` from Python, as the commands run them (`runner.compare`, `runner.frontier`): their
runs are `fit`'s, in the spec's root, so a call resumes what the command (or an earlier call) of the same
settings finished there."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ..core.errors import GhostdistillError
from .options import user_errors


def compare(spec: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> dict:
    """One `fit` per plan of a compare file, gathered into one report: what ``ghostdistill compare <spec>
    [overrides]`` runs and writes.

    Args:
        spec: the compare file's path, or a mapping of its keys: ``base`` (a `fit` config file), ``plans``
            (each a mapping of `PlanConfig` keys: ``{"criterion": "streamline", "num_layers": 7}``,
            ``{"layers": [12, 13]}``) and ``root`` (default ``runs/compare``).
        overrides: `fit` arguments for every plan, as on the command line: ``["--data.batch_size", "2"]``.

    Each plan runs in ``<root>/<plan name>/`` (a finished plan of the same settings is read back, one of other
    settings runs again); compare.json, .csv, .md and .png are written in the root. Returns what compare.json
    holds: ``report["rows"]``, one per plan, view and source, with ``ppl``, ``kl``, ``top1``, ``params``.
    Errors: `GhostdistillError`, with the command's one-line message, before any plan runs.
    """
    spec, overrides = _arguments("compare", spec, overrides, "base, plans, root")
    from ..runner.compare import compare_plans

    with user_errors():
        return compare_plans(spec, overrides)[1]


def frontier(spec: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> dict:
    """Per depth, every recovery entry of the base config on streamline's plan and on its repair-aware plan
    (with ``greedy``, on plans grown from the depth before; with ``students``, the best stock and operator
    views fine-tuned): what ``ghostdistill frontier <spec> [overrides]`` runs and writes.

    Args:
        spec: the frontier file's path, or a mapping of its keys: ``base`` (a `fit` config file),
            ``num_layers`` (a list of depths or ``{"first": a, "last": b}``), and optionally ``root`` (default
            ``runs/frontier``), ``criteria``, ``greedy`` and ``students``.
        overrides: `fit` arguments, as on the command line (``["--data.batch_size", "2"]``); they apply to the
            student runs too.

    Each depth's point is saved in the root (a later call of the same settings reads it back); frontier.json,
    .csv, .md and .png are written there. Returns what frontier.json holds: ``spec``, ``points`` (one per
    depth: every view's plan and metrics per criterion), ``students`` and the flat ``rows``. Errors:
    `GhostdistillError`, with the command's one-line message, before the model loads.
    """
    spec, overrides = _arguments("frontier", spec, overrides, "base, num_layers, root, criteria, greedy, students")
    from ..runner.frontier import frontier_depths

    with user_errors():
        return frontier_depths(spec, overrides)[1]


def _arguments(who: str, spec, overrides, keys: str) -> tuple[str | Mapping, list[str]]:
    """`spec` as a path string or a mapping, `overrides` as a list of strings; anything else is one line naming
    the argument and what it takes."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, (str, Mapping)):
        raise GhostdistillError(
            f"{who}() spec={spec!r}: give the {who} file's path or a mapping of its keys ({keys}), "
            f"not a {type(spec).__name__}"
        )
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, Sequence):
        raise GhostdistillError(
            f"{who}() overrides={overrides!r}: give a list of fit arguments, one string each, e.g. "
            "['--data.batch_size', '2']"
        )
    for item in overrides:
        if not isinstance(item, str):
            raise GhostdistillError(
                f"{who}() overrides item {item!r}: each fit argument is a string, e.g. '--data.batch_size' or "
                f"'{item}', not a {type(item).__name__}"
            )
    return spec, list(overrides)
