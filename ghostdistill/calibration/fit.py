"""From statistics to views: every gap of every recovery method solved, sequentially where asked.

Sequentially (`order: sequential`), gap k's statistics come from a fresh pass through the student
whose gaps before k are already repaired by the same method; one dense pass per batch serves all
methods (the first gap sees dense activations either way, so it reuses the shared statistics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from ..core.views import PrunedModel
from ..methods import Collector, GapFit, RecoveryConfig, get_method, make_collectors
from .distributed import sum_collectors
from .stream import accumulate_students

Batches = Sequence[dict[str, torch.Tensor]]


def register_view(pruned: PrunedModel, name: str, fits: dict[str, GapFit]) -> None:
    """(Re)register a method's view from its per-gap fits."""
    pruned.add_method(
        name,
        {key: f.operator for key, f in fits.items() if f.operator is not None},
        {key: f.mlp_map for key, f in fits.items() if f.mlp_map is not None},
    )


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
    """Fit every gap of every method and register each method's view (in config order, the order of
    the views in every report); returns each method's settings, what its fit cost (`fit_s`: its own
    student passes and solves plus an equal share of the shared dense passes) and its fits' `notes`.

    With several processes, `batches` is this rank's share and `reduce` sums a tensor over ranks: the
    student statistics of sequential fits are summed before each solve, like the shared ones."""
    gaps = pruned.plan.gaps
    methods = {cfg.name: get_method(cfg.method) for cfg in cfgs}
    typed = {cfg.name: cfg.method_config() for cfg in cfgs}
    fits = {cfg.name: {g.key: methods[cfg.name].identity(typed[cfg.name], hidden) for g in gaps} for cfg in cfgs}
    seconds = dict.fromkeys(fits, 0.0)
    notes: dict[str, list[str]] = {cfg.name: [] for cfg in cfgs}
    for cfg in cfgs:
        register_view(pruned, cfg.name, fits[cfg.name])
    for k, gap in enumerate(gaps):
        collectors = {cfg.name: stats[gap.key].get(cfg.method) for cfg in cfgs}
        sequential = [cfg for cfg in cfgs if k > 0 and cfg.order == "sequential" and collectors[cfg.name] is not None]
        if sequential:
            for cfg in sequential:
                register_view(pruned, cfg.name, fits[cfg.name])
                # Sized to this entry: a student pass of its own feeds only its fit.
                collectors[cfg.name] = make_collectors({cfg.method}, hidden, device, [cfg])[cfg.method]
            names = ", ".join(cfg.name for cfg in sequential)
            spent = accumulate_students(
                pruned,
                gap,
                progress(batches, f"student statistics for gap {gap.key} ({names})"),
                {cfg.name: {cfg.method: collectors[cfg.name]} for cfg in sequential},
            )
            for cfg in sequential:
                seconds[cfg.name] += spent[cfg.name] + spent["dense"] / len(sequential)
                if reduce is not None:
                    sum_collectors({cfg.method: collectors[cfg.name]}, reduce)
        for cfg in cfgs:
            start = time.perf_counter()
            fits[cfg.name][gap.key] = methods[cfg.name].fit(typed[cfg.name], gap, collectors[cfg.name], hidden)
            seconds[cfg.name] += time.perf_counter() - start
            if fits[cfg.name][gap.key].note:
                notes[cfg.name].append(f"gap {gap.key}: {fits[cfg.name][gap.key].note}")
    for cfg in cfgs:
        register_view(pruned, cfg.name, fits[cfg.name])
    # `notes`: what a fit had to say (e.g. an assumption that did not hold), for the log and results.md.
    return {
        cfg.name: {
            **cfg.settings(),
            "fit_s": round(seconds[cfg.name], 2),
            **({"notes": n} if (n := notes[cfg.name]) else {}),
        }
        for cfg in cfgs
    }
