"""``criterion: repair_greedy``: remove one block at a time, each step the block whose removal, with every
gap of the plan repaired, leaves the model closest to the dense one (KL on the selection windows).

Step t (t blocks removed, plan P_t) tries P_t ∪ {b} for every removable block b ∉ P_t (r − t candidates,
r the removable blocks) and keeps the lowest KL(dense ‖ repaired); the plan is P_n. Per candidate only
the gap that b joins or creates changes, and with `order: sequential` the gaps after it (their fit reads
the repaired student's activations); the fits of the gaps before it are reused from earlier candidates.

Forwards, with L blocks and n removed: step t collects the dense statistics of every new first gap in one
dense pass over the calibration windows (n passes in all), fits and scores r − t candidates (one forward
of the repaired candidate over the selection windows each: Σ_t (r − t) = n·r − n(n−1)/2 forwards, r ≤ L),
and with `order: sequential` one student pass over the calibration windows per gap at or after the
changed one (at most k_t − 1 per candidate, k_t ≤ t + 1 gaps): at most Σ_t (r − t)·t student passes,
O(n²·L). Plans that stay contiguous (one gap) cost no student pass.

`plan.greedy_start` removes its blocks before the first step (their gaps fitted as a kept plan's: one dense
pass), and the steps add the other n − |start| blocks; the steps are numbered from |start| + 1.

The search is deterministic, so a run with the same settings and another n has taken the same first
steps: `taken` (its report's steps, `plan.greedy_from`) starts the search after them, at the cost of one
dense pass for the kept plan's first gap; with n no more than the steps taken, nothing is searched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..core.plan import PruningPlan
from ..methods import RecoveryConfig
from .candidates import candidate_blocks, protected_edges
from .fitting import RepairAware, RepairFitter
from .interface import PlanConfig, PlanInputs, register
from .scoring import SelectionScorer


def repair_greedy_plan(plan_cfg: PlanConfig, cfg: RecoveryConfig, inputs: PlanInputs) -> PruningPlan:
    """The plan ``criterion: repair_greedy`` chooses, repairing with `cfg` and reading `inputs`' batches as
    they are; `candidates` holds per step the KL of every block tried ("step t": {block: KL}, and the block
    kept), `costs` the seconds and passes. `inputs.taken`: the steps of an earlier search with these settings
    (each {"kept", "kl", "tried"}), the first of this one; they are marked ``reused`` and cost nothing here."""
    model, stack, progress, taken = inputs.model, inputs.stack, inputs.progress, inputs.taken
    n, num_layers = plan_cfg.num_layers, len(stack.layers)
    keep_first, keep_last = protected_edges(plan_cfg)
    blocks = candidate_blocks(num_layers, n, keep_first, keep_last)
    start = time.perf_counter()
    scorer = SelectionScorer(model, inputs.selection, starts=blocks)
    fitter = RepairFitter(model, [cfg], inputs.batches, progress)
    removed = [int(step["kept"]) for step in taken[:n]]
    steps = {f"step {t + 1}": {**step, "reused": True} for t, step in enumerate(taken[:n])}
    start_blocks = list(plan_cfg.greedy_start or ())
    if outside := sorted(set(start_blocks) - set(blocks)):
        raise ValueError(
            f"plan.greedy_start {start_blocks}: blocks {outside} are not removable here (the model has "
            f"{num_layers} blocks; keep_first {keep_first} and keep_last {keep_last} protect the edges); "
            f"removable: {blocks[0]}..{blocks[-1]}"
        )
    if start_blocks:
        removed = list(start_blocks)
    if removed and len(removed) < n:
        # The kept plan's fits are made afresh (its first gap's dense statistics: one pass); the later
        # gaps' sequential fits are made by the first candidate that needs them, as in any step.
        kept = PruningPlan.from_layers(sorted(removed), num_layers, allow_edges=True)
        fitter.collect_dense(fitter.needed(kept), "repair_greedy statistics (the steps taken)")
        fitter.keep_only(kept.gaps)
    for t in range(len(removed), n):
        plans = {
            b: PruningPlan.from_layers(sorted([*removed, b]), num_layers, allow_edges=True)
            for b in blocks
            if b not in removed
        }
        fitter.collect_dense(
            [g for p in plans.values() for g in fitter.needed(p)], f"repair_greedy statistics (step {t + 1}/{n})"
        )
        tried: dict[int, float] = {}
        for b in progress(list(plans), f"repair_greedy: step {t + 1}/{n} ({cfg.name})"):
            pruned = fitter.repaired(plans[b], cache=True)
            try:
                tried[b] = scorer.score(pruned, [cfg.name], start=plans[b].gaps[0].start)[cfg.name]["kl"]
            finally:
                pruned.remove_hooks()
        best = min(tried, key=lambda b: (tried[b], b))
        removed.append(best)
        steps[f"step {t + 1}"] = {"kept": best, "kl": tried[best], "tried": {str(b): kl for b, kl in tried.items()}}
        fitter.keep_only(plans[best].gaps)
    seconds = time.perf_counter() - start
    return PruningPlan.from_layers(
        removed,
        num_layers,
        allow_edges=keep_first == 0 or keep_last == 0,
        chosen_by=f"repair_greedy ({cfg.name})",
        scores={str(b): steps[f"step {t + 1}"]["kl"] for t, b in enumerate(removed) if f"step {t + 1}" in steps},
        candidates=steps,
        costs={
            "total_s": round(seconds, 4),
            "dense_passes": fitter.passes["dense"],
            "student_passes": fitter.passes["student"],
            "selection_forwards": scorer.forwards,
            "reused_steps": len(taken[:n]),
            **({"start": sorted(start_blocks)} if start_blocks else {}),
        },
    )


def greedy_steps(plan_cfg: PlanConfig, fingerprint_at: Callable[[int], str]) -> list[dict]:
    """The steps of the ``repair_greedy`` run that `plan_cfg.greedy_from` names (none when unset), in order.
    That run's fingerprint must be `fingerprint_at(its num_layers)`, the one this run would have at that
    depth (the same model, data, selection, recovery, batch size and plan keys), so that its steps are this
    run's first ones."""
    source = plan_cfg.greedy_from
    if source is None:
        return []
    results = Path(source) / "results.json" if Path(source).is_dir() else Path(source)
    if not results.is_file():
        raise FileNotFoundError(
            f"plan.greedy_from {source!r}: {results} does not exist; name the folder (or results.json) of a "
            "finished repair_greedy run"
        )
    report = json.loads(results.read_text())
    plan = report.get("plan") or {}
    steps = plan.get("candidates") or {}
    if not str(plan.get("chosen_by", "")).startswith("repair_greedy") or not steps:
        raise ValueError(
            f"plan.greedy_from {source!r}: its plan was chosen by {plan.get('chosen_by')!r}, not repair_greedy; "
            "name a finished repair_greedy run"
        )
    if (report.get("calibration") or {}).get("fingerprint") != fingerprint_at(len(plan["removed"])):
        raise ValueError(
            f"plan.greedy_from {source!r} was run with other settings than this run (model, calibration, "
            "selection, recovery, batch size or plan keys besides num_layers): its steps need not be this "
            "run's; remove plan.greedy_from, or name a repair_greedy run of these settings"
        )
    return [steps[f"step {t}"] for t in range(1, len(steps) + 1)]


register(RepairAware("repair_greedy", repair_greedy_plan))
