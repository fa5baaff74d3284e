"""``criterion: repair``: the contiguous run of `num_layers` blocks whose repaired model is closest to the
dense one.

For every start i allowed by `keep_first`, `keep_last` and `allow_edges` (candidates c = L − n + 1 less
the protected ones): the statistics of gap [i, i+n) (one dense pass for all of them, or one per chunk of
`repair_chunk`), the repair method's fit, then KL(dense ‖ repaired) and KL(dense ‖ pruned) on the
selection windows. The streamline criterion's cosine of every candidate comes from its own dense pass,
both for the table and as the time the repair-aware choice is measured against.

Cost: 1 + ⌈c / chunk⌉ dense passes over the calibration windows (streamline: 1), c solves per method, and
c·(1 + methods) forwards of the (L − n)-block candidate over the selection windows. Memory: chunk × what
the methods' collectors hold, float64 on the model's device (ghost `first_weighted`: 2 C² + O(C) values,
256 MiB per candidate at C = 4096, 1 GiB at C = 8192).

`score_runs` scores several methods from the same pass (the frontier: every method's own best run and
streamline's, from one calibration pass per depth); `repair_plan` is it with one method.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

from ..core.model import DecoderStack
from ..core.plan import Gap, PruningPlan
from ..core.views import PRUNED
from ..methods import GapFit, RecoveryConfig
from .candidates import protected_edges
from .fitting import RepairAware, RepairFitter
from .interface import Batch, PlanConfig, PlanInputs, register
from .scoring import SelectionScorer
from .similarity import block_similarity


@dataclass
class Runs:
    """Every contiguous candidate of one depth: per start its row (streamline's cosine, the pruned KL and
    top-1, and per method ``<name>_kl`` and ``<name>_top1``), the fits of the starts asked to be kept, the
    costs."""

    rows: dict[int, dict] = field(default_factory=dict)
    fits: dict[tuple[str, int], GapFit] = field(default_factory=dict)
    costs: dict[str, float] = field(default_factory=dict)

    def streamline(self) -> int:
        """Streamline's choice: the highest cosine (ties: the earliest)."""
        return max(self.rows, key=lambda i: (self.rows[i]["cosine"], -i))

    def best(self, name: str | None) -> int:
        """The lowest repaired KL of method `name` (None: the pruned KL), ties to the earliest."""
        key = "pruned_kl" if name is None else f"{name}_kl"
        return min(self.rows, key=lambda i: (self.rows[i][key], i))


def score_runs(
    plan_cfg: PlanConfig,
    cfgs: Sequence[RecoveryConfig],
    model: nn.Module,
    stack: DecoderStack,
    batches: Sequence[Batch],
    selection: Sequence[Batch],
    progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
    keep_fits: bool = False,
) -> Runs:
    """Fit and score every method of `cfgs` on every contiguous run of `plan_cfg.num_layers` blocks. With
    `keep_fits`, the fits of each method's best run so far and of streamline's run are kept (`Runs.fits`)."""
    n, num_layers = plan_cfg.num_layers, len(stack.layers)
    keep_first, keep_last = protected_edges(plan_cfg)
    runs = Runs()
    costs = runs.costs
    start = time.perf_counter()
    cosine = block_similarity(
        model, stack, progress(batches, "streamline cosines"), n, keep_first=keep_first, keep_last=keep_last
    )
    costs["streamline_s"] = time.perf_counter() - start
    starts = sorted(cosine)
    streamline = max(starts, key=lambda i: (cosine[i]["cosine"], -i))
    start = time.perf_counter()
    scorer = SelectionScorer(model, selection, starts=starts)
    costs["selection_dense_s"] = time.perf_counter() - start
    fitter = RepairFitter(model, cfgs, batches, progress)
    chunk = plan_cfg.repair_chunk or len(starts)
    costs["statistics_s"] = costs["fit_s"] = costs["score_s"] = 0.0
    for first in range(0, len(starts), chunk):
        part = starts[first : first + chunk]
        t0 = time.perf_counter()
        fitter.collect_dense([Gap(i, i + n) for i in part], f"repair statistics ({len(part)} candidates)")
        costs["statistics_s"] += time.perf_counter() - t0
        for i in progress(part, f"repair: fit and score ({', '.join(fitter.names)})"):
            t0 = time.perf_counter()
            candidate = PruningPlan.from_layers(list(range(i, i + n)), num_layers, allow_edges=True)
            pruned = fitter.repaired(candidate)
            t1 = time.perf_counter()
            try:
                scores = scorer.score(pruned, [PRUNED, *fitter.names], start=i)
                row = {"start": i, "cosine": cosine[i]["cosine"]}
                for view, s in scores.items():
                    row |= {f"{view}_kl": s["kl"], f"{view}_top1": s["top1"]}
                runs.rows[i] = row
                if keep_fits:
                    key = Gap(i, i + n).key
                    for name in fitter.names:
                        if i == streamline or runs.best(name) == i:
                            op = pruned.operators[name][key] if key in pruned.operators[name] else None
                            mlp = pruned.mlp_maps[name][key] if key in pruned.mlp_maps[name] else None
                            runs.fits[(name, i)] = GapFit(operator=op, mlp_map=mlp)
                    best = {runs.best(name) for name in fitter.names} | {streamline}
                    runs.fits = {k: v for k, v in runs.fits.items() if k[1] in best}
            finally:
                pruned.remove_hooks()
            costs["fit_s"] += t1 - t0
            costs["score_s"] += time.perf_counter() - t1
        fitter.keep_only([])  # this chunk's statistics are no longer needed
    costs["total_s"] = sum(costs.values())
    costs |= {
        "dense_passes": fitter.passes["dense"],
        "candidates": len(runs.rows),
        "selection_windows": sum(len(b["input_ids"]) for b in selection),
        "relative_to_streamline": costs["total_s"] / max(costs["streamline_s"], 1e-9),
    }
    runs.costs = {k: round(v, 4) if isinstance(v, float) else v for k, v in costs.items()}
    return runs


def repair_plan(plan_cfg: PlanConfig, cfg: RecoveryConfig, inputs: PlanInputs) -> PruningPlan:
    """The plan ``criterion: repair`` chooses, repairing with `cfg` and reading `inputs`' batches as they are;
    `PruningPlan.candidates` holds every candidate's row (start, streamline's cosine, pruned and repaired KL
    and top-1) and `costs` the seconds of each part."""
    runs = score_runs(plan_cfg, [cfg], inputs.model, inputs.stack, inputs.batches, inputs.selection, inputs.progress)
    n = plan_cfg.num_layers
    rows = {
        Gap(i, i + n).key: {
            "start": i,
            "cosine": r["cosine"],
            "pruned_kl": r["pruned_kl"],
            "repaired_kl": r[f"{cfg.name}_kl"],
            "repaired_top1": r[f"{cfg.name}_top1"],
        }
        for i, r in runs.rows.items()
    }
    best = runs.best(cfg.name)
    keep_first, keep_last = protected_edges(plan_cfg)
    return PruningPlan.from_layers(
        list(range(best, best + n)),
        len(inputs.stack.layers),
        allow_edges=keep_first == 0 or keep_last == 0,
        chosen_by=f"repair ({cfg.name})",
        scores={k: r["repaired_kl"] for k, r in rows.items()},
        candidates=rows,
        costs=runs.costs,
    )


register(RepairAware("repair", repair_plan, contiguous=True))
