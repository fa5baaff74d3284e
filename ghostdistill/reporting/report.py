"""The run report: one typed record that the phases of a run fill and `reporting.results` writes.

Each phase owns its section and sets it once: the plan and calibration (`pipeline.calibrate`), the
per-method fits, the evaluation of every view (`pipeline.evaluate`), distillation (`pipeline.train`),
zero-shot scores, the analyses, and the seconds each phase took; `settings` (set by `fit`,
`pipeline.settings.result_settings`) is every setting that decides the numbers, so `compare` reuses a result
only when it matches. `to_dict` gives what results.json holds; export and `compare` read that JSON, so a run
folder written by an earlier process reads the same way as an in-memory run.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class SourceMetrics:
    """One view on one evaluation source: perplexity over `tokens` next-token predictions, and (for
    every view but dense) mean per-token KL(dense ‖ view) and top-1 agreement with the dense model; on a
    chat source (the chat score, `data.run_chat`) those are on the dense model's answer tokens, and `prefix`
    is the mean number of answer tokens the view's greedy answer shares with the dense one."""

    ppl: float
    tokens: int
    kl: float | None = None
    top1: float | None = None
    prefix: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ViewResult:
    """A view's parameter count, its metrics per evaluation source and, with zero-shot, its scores."""

    params: int
    metrics: dict[str, SourceMetrics]
    zeroshot: dict[str, dict[str, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": self.params, "metrics": {s: m.to_dict() for s, m in self.metrics.items()}}
        return out if self.zeroshot is None else {**out, "zeroshot": self.zeroshot}


@dataclass
class RunReport:
    """Everything a run measured (see the module docstring for who fills what)."""

    model: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None
    recovery: dict[str, dict[str, Any]] = field(default_factory=dict)
    views: dict[str, ViewResult] = field(default_factory=dict)
    distill: dict[str, Any] | None = None
    zeroshot: dict[str, Any] | None = None
    analysis: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Per phase of `pipeline.run.Run`: seconds, how many times it ran, peak memory (`Run.on_phase`).
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    settings: dict[str, Any] | None = None

    @contextmanager
    def timed(self, phase: str):
        """Record the seconds the body takes as `timings[<phase>_s]`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[f"{phase}_s"] = round(time.perf_counter() - start, 2)

    def to_dict(self) -> dict[str, Any]:
        """What results.json holds: the model, timings and phases, then the other sections in the order they are
        declared (sections a run did not reach are left out)."""
        out: dict[str, Any] = {"model": self.model, "timings": self.timings, "phases": self.phases}
        for f in fields(self):
            value = {v: r.to_dict() for v, r in self.views.items()} if f.name == "views" else getattr(self, f.name)
            if f.name not in out and value is not None:
                out[f.name] = value
        return out
