"""The repairs of a candidate plan: its gaps' statistics from the dense pass (cached by gap) and every
recovery entry's closed-form fit by the one sequential fitter (`calibration.fit.SequentialFitter`, cached by
the gaps it depends on), each registered as the entry's view.

Statistics are sums over tokens, and the inputs of every gap [i, j) of the dense model, X_pre entering
block i and X_post entering block j, are block inputs of one dense forward: `collect_dense` feeds any
number of candidate gaps, for every entry at once, from one pass over the calibration batches
(`calibration.stream.accumulate`, the function a single-plan calibration calls, so a candidate's
statistics are exactly that plan's). With `order: sequential` the fit of gap g_k reads the activations
the student repaired at g₁ … g_{k−1} feeds it: one student pass per such gap (shared by the entries that
need it), reused by every later candidate whose gaps up to g_k are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..calibration.fit import SequentialFitter, student_pass
from ..calibration.stream import accumulate
from ..core.model import decoder_stack, hidden_size
from ..core.offload import model_device
from ..core.plan import Gap, PruningPlan
from ..core.views import PrunedModel
from ..methods import Collector, RecoveryConfig, make_collectors, registered
from .candidates import first_windows
from .interface import Batch, Criterion, PlanConfig, PlanInputs


def repair_config(plan_cfg: PlanConfig, recovery: Sequence[RecoveryConfig]) -> RecoveryConfig:
    """The recovery entry that repairs every candidate: `plan.repair_method` names an entry of `recovery`
    (its settings) or a registered method (its defaults); unset, the first entry."""
    name = plan_cfg.repair_method
    if name is None:
        if not recovery:
            raise ValueError(f"plan.criterion {plan_cfg.criterion!r} needs plan.repair_method or a recovery entry")
        return recovery[0]
    for cfg in recovery:
        if cfg.name == name:
            return cfg
    if name in registered():
        return RecoveryConfig(name=name, method=name)
    raise ValueError(
        f"plan.repair_method {name!r} is neither a recovery entry ({', '.join(c.name for c in recovery)}) nor a "
        f"registered method ({', '.join(registered())})"
    )


@dataclass(frozen=True)
class RepairAware(Criterion):
    """A repair-aware criterion: `search(cfg, entry, inputs)` is its plan, from the entry that repairs every
    candidate and the calibration batches its candidates' statistics read (the first `criterion_samples`
    windows; the chosen plan's fits read them all). Refuses a run without selection windows, where the
    candidates are scored."""

    name: str
    search: Callable[[PlanConfig, RecoveryConfig, PlanInputs], PruningPlan]
    contiguous: bool = False
    costly = True
    repair_aware = True

    def choose(self, cfg: PlanConfig, inputs: PlanInputs) -> PruningPlan:
        entry = repair_config(cfg, inputs.recovery)
        if not inputs.selection:
            raise ValueError(
                f"plan.criterion {cfg.criterion!r} scores each repaired candidate on held-out windows, and "
                "there are none: set data.selection (a source and num_windows, disjoint from calibration and "
                "evaluation)"
            )
        batches = list(first_windows(inputs.batches, cfg.criterion_samples))
        return self.search(cfg, entry, replace(inputs, batches=batches))


class RepairFitter:
    """Fits every entry of `cfgs` to candidate plans of `model` from `batches` (the calibration windows): the
    dense statistics of every gap collected (`collect_dense`), the fits by the one sequential fitter
    (`calibration.fit.SequentialFitter`), whose student passes read the same batches.

    `passes` counts the passes over the calibration batches: ``dense`` (each serves every gap collected
    in it) and ``student`` (one per sequential gap fitted afresh, shared by the entries that need it)."""

    def __init__(
        self,
        model: nn.Module,
        cfgs: Sequence[RecoveryConfig],
        batches: Sequence[Batch],
        progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
    ) -> None:
        self.model, self.cfgs, self.batches, self.progress = model, list(cfgs), batches, progress
        self.hidden = hidden_size(model)
        self.device = model_device(model)
        self.dense: dict[tuple[int, int], dict[str, Collector]] = {}
        self.dense_passes = 0
        student = student_pass(batches, progress, "repair: student statistics")
        self.fitter = SequentialFitter(self.cfgs, self.hidden, self.device, student)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.cfgs]

    @property
    def passes(self) -> dict[str, int]:
        return {"dense": self.dense_passes, "student": self.fitter.student_passes}

    def needed(self, plan: PruningPlan) -> list[Gap]:
        """The gaps of `plan` fitted on dense statistics: the first (every gap when an entry has
        `order: independent`)."""
        return plan.gaps if not all(self.fitter.sequential.values()) else plan.gaps[:1]

    @torch.no_grad()
    def collect_dense(self, gaps: Iterable[Gap], desc: str = "repair statistics") -> None:
        """Dense statistics of every gap in `gaps` not held yet, for every entry, from one pass over the
        batches (one collector per method, sized to that method's entries)."""
        missing = list({(g.start, g.stop): g for g in gaps if (g.start, g.stop) not in self.dense}.values())
        if not missing:
            return
        methods = {c.method for c in self.cfgs}
        stats = {g.key: make_collectors(methods, self.hidden, self.device, self.cfgs) for g in missing}
        if any(stats[g.key] for g in missing):
            # The model is dense here (no view switched in): the taps are the dense model's block inputs.
            accumulate(self.model, decoder_stack(self.model), missing, self.progress(self.batches, desc), stats)
            self.dense_passes += 1
        for g in missing:
            self.dense[(g.start, g.stop)] = stats[g.key]

    def keep_only(self, gaps: Iterable[Gap]) -> None:
        """Forget the dense statistics of every gap but `gaps`, and every fit that does not start with them."""
        keep = [(g.start, g.stop) for g in gaps]
        self.dense = {k: v for k, v in self.dense.items() if k in keep}
        self.fitter.fits = {k: v for k, v in self.fitter.fits.items() if list(k[1]) == keep[: len(k[1])]}

    def _dense(self, gap: Gap) -> dict[str, Collector]:
        if (gap.start, gap.stop) not in self.dense:
            raise KeyError(f"gap {gap.key}: dense statistics were not collected (call collect_dense first)")
        return self.dense[(gap.start, gap.stop)]

    def repaired(self, plan: PruningPlan, cache: bool = False) -> PrunedModel:
        """A `PrunedModel` of `plan` with one view per entry (its name), every gap fitted. With `cache`, the
        fits are kept for later plans that share their gaps. The caller removes its hooks (`remove_hooks`)."""
        pruned = PrunedModel(self.model, plan)
        self.fitter.fit(pruned, self._dense, cache=cache)
        return pruned
