"""Zero-shot summaries: lm-eval's output as per-task accuracy (`ZeroShotResults`), the papers' average, and
how many items of each task to score. Nothing here imports lm-eval."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .tasks import loaders as _loaders

log = logging.getLogger(__name__)

#: The metrics kept per task (lm-eval's ``<metric>,none`` keys).
METRICS: tuple[str, ...] = ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")


def as_list(tasks: Sequence[str] | str) -> list[str]:
    # A bare string is a Sequence[str] too; treat it as one task, not letters.
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    if not names:
        raise ValueError("no tasks given")
    return list(dict.fromkeys(names))  # drop repeats, keep order


class ZeroShotResults(dict[str, dict[str, float]]):
    """The summary returned by :func:`evaluate_zeroshot`: a plain dict, plus ``raw``.

    ``raw`` is lm-eval's full ``simple_evaluate`` output, with lm-eval's task names (task configs, versions,
    sample counts and, with ``log_samples=True``, its ``"samples"``), for anyone who needs more than the summary.
    It is not among the dict's items and is dropped when the summary is pickled or copied: it holds task
    callables that need not pickle.
    """

    def __init__(self, *args: Any, raw: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.raw: dict[str, Any] = raw if raw is not None else {}

    def __reduce__(self) -> tuple[type[ZeroShotResults], tuple[dict[str, dict[str, float]]]]:
        return (type(self), (dict(self),))

    @property
    def samples(self) -> dict[str, list[dict[str, Any]]] | None:
        """lm-eval's per-document records by lm-eval task name (``log_samples=True`` only)."""
        return self.raw.get("samples")


def summarize(raw: dict[str, Any], order: Sequence[str]) -> ZeroShotResults:
    groups = set(raw.get("group_subtasks", {}))
    per_task: dict[str, dict[str, float]] = {}
    for name, metrics in raw["results"].items():
        if name in groups:
            continue  # group rows repeat their subtasks' numbers
        # lm-eval reports "N/A" for a stderr it could not compute.
        row = {m: float(v) for m in METRICS if isinstance(v := metrics.get(f"{m},none"), (int, float))}
        if "acc" not in row:
            log.warning("task %s reports no acc; left out of the summary", name)
            continue
        row["n"] = int(raw["n-samples"][name]["effective"])
        per_task[name.removeprefix(_loaders.TASK_PREFIX)] = row

    rank = {name: i for i, name in enumerate(order)}
    summary = ZeroShotResults(sorted(per_task.items(), key=lambda kv: rank.get(kv[0], len(rank))), raw=raw)
    if per_task:
        summary["average"] = average_scores(per_task)
    return summary


def average_scores(per_task: dict[str, dict[str, float]]) -> dict[str, float]:
    """The papers' average: mean ``acc`` over tasks; ``acc_norm`` over the tasks that report it."""
    rows = [r for name, r in per_task.items() if name != "average"]
    if not rows:
        raise ValueError("no task scores to average")
    average = {"acc": sum(r["acc"] for r in rows) / len(rows)}
    with_norm = [r["acc_norm"] for r in rows if "acc_norm" in r]
    if with_norm:
        average["acc_norm"] = sum(with_norm) / len(with_norm)
    return average


def task_limits(tasks: Sequence[str], limit: int | dict[str, int | None] | None) -> dict[str, int | None]:
    """Items to score per task: one ``limit`` for all, or a ``{task: limit}`` map (absent tasks: all items). A
    limit that is not a positive integer, or a map naming a task not in ``tasks``, raises ValueError."""

    def check(value: int | None, where: str) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"zero-shot limit{where} must be a positive integer or null (all items), got {value!r}")
        return value

    names = as_list(tasks)
    if not isinstance(limit, dict):
        return {t: check(limit, "") for t in names}
    unknown = [t for t in limit if t not in names]
    if unknown:
        raise ValueError(
            f"zero-shot limit names task(s) {', '.join(map(repr, unknown))} that are not in tasks: {', '.join(names)}"
        )
    return {t: check(limit.get(t), f" for {t!r}") for t in names}
