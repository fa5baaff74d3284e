"""From statistics to views: every gap of every recovery entry solved, sequentially where asked, by one fitter
(`SequentialFitter`) that serves calibration (`fit_methods`), the repair-aware criteria
(`planning.fitting.RepairFitter`) and the frontier.

Sequentially (`order: sequential`), gap k's statistics come from a pass through the student whose gaps before k are
already repaired by the same entry; the first gap sees dense activations either way, so it reads the dense
statistics. The fitter is written in terms of statistics of a gap from a pass: the dense statistics of a gap are
given (`dense(gap)`: one collector per method, from whatever pass made them), and the student statistics of a gap
come from a `StudentPass` (by default `student_pass`: `calibration.stream.accumulate_students` over the calibration
batches, one dense forward per batch shared by every entry), so another way of running a pass slots in there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ..core.plan import Gap
from ..core.views import PrunedModel
from ..methods import Collector, GapFit, Ordered, RecoveryConfig, get_method, make_collectors
from .distributed import sum_collectors
from .stream import accumulate_students

Batches = Sequence[dict[str, torch.Tensor]]
# (pruned, gap, {view: {method: collector}}) -> seconds spent ("dense" and per view): feeds each view's
# collectors the taps of `gap` with the view's earlier gaps repaired.
StudentPass = Callable[[PrunedModel, Gap, dict[str, dict[str, Collector]]], dict[str, float]]


def register_view(pruned: PrunedModel, name: str, fits: dict[str, GapFit]) -> None:
    """(Re)register a method's view from its per-gap fits."""
    pruned.add_method(
        name,
        {key: f.operator for key, f in fits.items() if f.operator is not None},
        {key: f.mlp_map for key, f in fits.items() if f.mlp_map is not None},
    )


def student_pass(
    batches: Batches,
    progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
    desc: str = "student statistics",
) -> StudentPass:
    """The student statistics of a gap from one pass over `batches` (`accumulate_students`)."""

    def run(pruned: PrunedModel, gap: Gap, collectors: dict[str, dict[str, Collector]]) -> dict[str, float]:
        return accumulate_students(
            pruned, gap, progress(batches, f"{desc} for gap {gap.key} ({', '.join(collectors)})"), collectors
        )

    return run


class SequentialFitter:
    """Fits every entry of `cfgs` to a plan's gaps in order (module docstring; `student`: its student passes),
    registering each entry's fits as its view (its name). With `reduce` (several processes), the student
    statistics are summed over ranks before each solve, like the shared ones.

    `fits` keeps the fits made with ``cache=True``, keyed by entry and the gaps a fit depends on (the gap, or
    every gap up to it for a sequential one), for later plans that share them; `student_passes` counts the
    passes run and `seconds` each entry's cost (its own student passes and solves plus an equal share of the
    dense forwards of the student passes it shared)."""

    def __init__(
        self,
        cfgs: Sequence[RecoveryConfig],
        hidden: int,
        device: torch.device | str,
        student: StudentPass,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.cfgs, self.hidden, self.device, self.student, self.reduce = list(cfgs), hidden, device, student, reduce
        self.methods = {c.name: get_method(c.method) for c in self.cfgs}
        self.typed = {c.name: c.method_config() for c in self.cfgs}
        self.sequential = {n: isinstance(t, Ordered) and t.order == "sequential" for n, t in self.typed.items()}
        self.fits: dict[tuple[str, tuple], GapFit] = {}
        self.student_passes = 0
        self.seconds = {c.name: 0.0 for c in self.cfgs}
        self.notes: dict[str, list[str]] = {c.name: [] for c in self.cfgs}  # what the fits said (`GapFit.note`)

    def fit(
        self, pruned: PrunedModel, dense: Callable[[Gap], dict[str, Collector]], cache: bool = False
    ) -> dict[str, dict[str, GapFit]]:
        """Fit every gap of `pruned.plan` for every entry and register the views; `dense(gap)`: the dense
        statistics of a gap (one collector per method). Returns the fits per entry and gap."""
        gaps = pruned.plan.gaps
        fits = {
            c.name: {g.key: self.methods[c.name].identity(self.typed[c.name], self.hidden) for g in gaps}
            for c in self.cfgs
        }
        for name, f in fits.items():
            register_view(pruned, name, f)
        for k, gap in enumerate(gaps):
            keys = {
                c.name: tuple((g.start, g.stop) for g in (gaps[: k + 1] if self.sequential[c.name] else [gap]))
                for c in self.cfgs
            }
            fresh = self._student_statistics(pruned, gap, fits, k, keys)
            for c in self.cfgs:
                fit = self.fits.get((c.name, keys[c.name]))
                if fit is None:
                    stats = fresh[c.name] if c.name in fresh else dense(gap).get(c.method)
                    start = time.perf_counter()
                    fit = self.methods[c.name].fit(self.typed[c.name], gap, stats, self.hidden)
                    self.seconds[c.name] += time.perf_counter() - start
                    if fit.note:
                        self.notes[c.name].append(f"gap {gap.key}: {fit.note}")
                    if cache:
                        self.fits[(c.name, keys[c.name])] = fit
                fits[c.name][gap.key] = fit
        for name, f in fits.items():
            register_view(pruned, name, f)
        return fits

    def _student_statistics(
        self, pruned: PrunedModel, gap: Gap, fits: dict, k: int, keys: dict
    ) -> dict[str, Collector | None]:
        """The statistics of `gap` from the repaired students of the sequential entries that need them (past
        the first gap, not cached), from one student pass; sized to each entry."""
        cfgs = [c for c in self.cfgs if self.sequential[c.name] and k > 0 and (c.name, keys[c.name]) not in self.fits]
        fresh: dict[str, Collector | None] = {}
        for c in cfgs:
            register_view(pruned, c.name, fits[c.name])
            fresh[c.name] = make_collectors({c.method}, self.hidden, self.device, [c]).get(c.method)
        reading = {c.name: {c.method: fresh[c.name]} for c in cfgs if fresh[c.name] is not None}
        if reading:
            spent = self.student(pruned, gap, reading)
            self.student_passes += 1
            for name in reading:
                self.seconds[name] += spent[name] + spent["dense"] / len(reading)
                if self.reduce is not None:
                    sum_collectors(reading[name], self.reduce)
        return fresh


def fit_methods(
    cfgs: list[RecoveryConfig],
    pruned: PrunedModel,
    stats: dict[str, dict[str, Collector]],
    batches: Batches,
    hidden: int,
    device: torch.device | str,
    progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, dict]:
    """Fit every gap of every method from the calibration statistics `stats` (gap key -> method -> collector)
    and register each method's view (in config order, the order of the views in every report); returns each
    method's settings, what its fit cost (`fit_s`, `SequentialFitter.seconds`) and its fits' `notes`.

    With several processes, `batches` is this rank's share and `reduce` sums a tensor over ranks."""
    fitter = SequentialFitter(cfgs, hidden, device, student_pass(batches, progress), reduce)
    fitter.fit(pruned, lambda gap: stats[gap.key])
    return {
        cfg.name: {
            **cfg.settings(),
            "fit_s": round(fitter.seconds[cfg.name], 2),
            **({"notes": n} if (n := fitter.notes[cfg.name]) else {}),
        }
        for cfg in cfgs
    }
