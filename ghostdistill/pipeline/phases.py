"""A run's phases, timed: each reports its seconds and peak memory (`core.measure.PeakMemory`) to the run's
observers (`PhaseObserver`; `observe(...)` adds process-wide ones, how scripts time a `fit` they start through
the CLI) and to results.json's `phases` (`Run.report.phases`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..core.measure import PEAK

Run = Any  # a `pipeline.run.Run` (not imported: it imports this module)

GIB = 2**30


class PhaseObserver:
    """Told when each phase of a `Run` starts and how long it took (`info`: e.g. a step's tokens)."""

    def start(self, name: str, run: Run) -> None:
        pass

    def on_phase(self, name: str, seconds: float, peak_bytes: int | None, run: Run, **info) -> None:
        pass


_OBSERVERS: list[PhaseObserver] = []


@contextmanager
def observe(*observers: PhaseObserver) -> Iterator[None]:
    """Every `Run` of this process reports to `observers` while the block runs (a `fit` started through
    the CLI, whose `Run` the caller never holds)."""
    _OBSERVERS.extend(observers)
    try:
        yield
    finally:
        for o in observers:
            _OBSERVERS.remove(o)


class Phases:
    """`begin` / `end` / `phase` of a `pipeline.run.Run`, which holds `observers`, `report` and `_since` (each open
    phase's start); peak memory is the process's measurer's (`core.measure.PEAK`), one span per run and phase."""

    def begin(self, name: str) -> None:
        for o in [*self.observers, *_OBSERVERS]:
            o.start(name, self)
        PEAK.start((id(self), name))
        self._since[name] = time.perf_counter()

    def end(self, name: str, **info) -> None:
        seconds, peak = time.perf_counter() - self._since.pop(name), PEAK.stop((id(self), name))
        row = self.report.phases.setdefault(name, {"seconds": 0.0, "count": 0, "peak_gib": None})
        row["seconds"], row["count"] = round(row["seconds"] + seconds, 3), row["count"] + 1
        if peak is not None:
            row["peak_gib"] = max(row["peak_gib"] or 0.0, round(peak / GIB, 3))
        for o in [*self.observers, *_OBSERVERS]:
            o.on_phase(name, seconds, peak, self, **info)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)
