"""The repairs of a candidate plan: its gaps' statistics from the dense pass (cached by gap) and every
recovery entry's closed-form fit (cached by the gaps it depends on), each registered as the entry's view.

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

import torch
from torch import nn

from ..calibration.fit import register_view
from ..calibration.stream import accumulate, accumulate_students
from ..core.model import decoder_stack, hidden_size
from ..core.offload import model_device
from ..core.plan import Gap, PruningPlan
from ..core.views import PrunedModel
from ..methods import Collector, GapFit, RecoveryConfig, get_method, make_collectors, registered
from .candidates import first_windows
from .interface import Batch, PlanConfig, PlanInputs


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


def repair_inputs(cfg: PlanConfig, inputs: PlanInputs) -> tuple[RecoveryConfig, list[Batch]]:
    """What a repair-aware criterion starts from: the entry that repairs every candidate, and the
    calibration batches its candidates' statistics read (the first `criterion_samples` windows; the chosen
    plan's fits read them all). Refuses a run without selection windows, where the candidates are scored."""
    entry = repair_config(cfg, inputs.recovery)
    if not inputs.selection:
        raise ValueError(
            f"plan.criterion {cfg.criterion!r} scores each repaired candidate on held-out windows, and "
            "there are none: set data.selection (a source and num_windows, disjoint from calibration and "
            "evaluation)"
        )
    return entry, list(first_windows(inputs.batches, cfg.criterion_samples))


def _key(gaps: Sequence[Gap]) -> tuple[tuple[int, int], ...]:
    return tuple((g.start, g.stop) for g in gaps)


class RepairFitter:
    """Fits every entry of `cfgs` to candidate plans of `model` from `batches` (the calibration windows).

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
        self.methods = {c.name: get_method(c.method) for c in self.cfgs}
        self.typed = {c.name: c.method_config() for c in self.cfgs}
        self.hidden = hidden_size(model)
        self.device = model_device(model)
        self.dense: dict[tuple[int, int], dict[str, Collector]] = {}
        self.fits: dict[tuple[str, tuple], GapFit] = {}
        self.passes = {"dense": 0, "student": 0}
        self.sequential = {c.name: getattr(c, "order", None) == "sequential" for c in self.cfgs}

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.cfgs]

    def needed(self, plan: PruningPlan) -> list[Gap]:
        """The gaps of `plan` fitted on dense statistics: the first (every gap when an entry has
        `order: independent`)."""
        return plan.gaps if not all(self.sequential.values()) else plan.gaps[:1]

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
            self.passes["dense"] += 1
        for g in missing:
            self.dense[(g.start, g.stop)] = stats[g.key]

    def keep_only(self, gaps: Iterable[Gap]) -> None:
        """Forget the dense statistics of every gap but `gaps`, and every fit that does not start with them."""
        keep = [(g.start, g.stop) for g in gaps]
        self.dense = {k: v for k, v in self.dense.items() if k in keep}
        self.fits = {k: v for k, v in self.fits.items() if list(k[1]) == keep[: len(k[1])]}

    def repaired(self, plan: PruningPlan, cache: bool = False) -> PrunedModel:
        """A `PrunedModel` of `plan` with one view per entry (its name), every gap fitted. With `cache`, the
        fits are kept for later plans that share their gaps. The caller removes its hooks (`remove_hooks`)."""
        pruned = PrunedModel(self.model, plan)
        gaps = plan.gaps
        fits = {
            c.name: {g.key: self.methods[c.name].identity(self.typed[c.name], self.hidden) for g in gaps}
            for c in self.cfgs
        }
        for name, f in fits.items():
            register_view(pruned, name, f)
        for k, gap in enumerate(gaps):
            keys = {
                c.name: _key(gaps[: k + 1]) if self.sequential[c.name] and k > 0 else _key([gap]) for c in self.cfgs
            }
            student = [
                c for c in self.cfgs if self.sequential[c.name] and k > 0 and (c.name, keys[c.name]) not in self.fits
            ]
            fresh: dict[str, Collector | None] = {}
            if student:
                for c in student:
                    register_view(pruned, c.name, fits[c.name])
                    fresh[c.name] = make_collectors({c.method}, self.hidden, self.device, [c]).get(c.method)
                reading = {c.name: {c.method: fresh[c.name]} for c in student if fresh[c.name] is not None}
                if reading:
                    accumulate_students(
                        pruned,
                        gap,
                        self.progress(self.batches, f"repair: student statistics for gap {gap.key}"),
                        reading,
                    )
                    self.passes["student"] += 1
            for c in self.cfgs:
                cached = self.fits.get((c.name, keys[c.name]))
                if cached is not None:
                    fits[c.name][gap.key] = cached
                    continue
                if c.name in fresh:
                    stats = fresh[c.name]
                elif (gap.start, gap.stop) in self.dense:
                    stats = self.dense[(gap.start, gap.stop)].get(c.method)
                else:
                    raise KeyError(f"gap {gap.key}: dense statistics were not collected (call collect_dense first)")
                fits[c.name][gap.key] = self.methods[c.name].fit(self.typed[c.name], gap, stats, self.hidden)
                if cache:
                    self.fits[(c.name, keys[c.name])] = fits[c.name][gap.key]
        for name, f in fits.items():
            register_view(pruned, name, f)
        return pruned
