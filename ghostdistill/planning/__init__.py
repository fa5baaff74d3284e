"""Repair-aware planning: remove the blocks whose gap the closed-form repair fixes best.

The pre-repair criteria (`ghostdistill.criteria`) rank blocks by how little the residual stream changes
across them; the repair is then fitted to whatever was chosen. The question a user asks is about the
model after repair, so these criteria answer it directly. For a candidate plan P with gaps g₁ … g_k:

    fit     W_g for every gap g of P from calibration statistics (the repair method's closed form;
            gap g₁ on dense activations, later gaps on the repaired student's when `order: sequential`)
    score   KL(dense ‖ P repaired) = mean over held-out tokens t of Σ_v q_v(t) (log q_v(t) − log p_v(t)),
            q the dense model's next-token distribution, p the repaired candidate's
    choose  the candidate with the lowest score (ties: the earliest block)

on selection windows that neither calibration nor evaluation reads (`data.selection`). The fit's own
residual is not the score: the last blocks change the stream most yet are the easiest to fit relative to
that change, and their repaired perplexity is the worst. Nothing is pre-filtered by a pre-repair score
either: on some families the best-repaired block has near-zero cosine similarity.

- `repair.repair_plan` (``criterion: repair``): every contiguous run of `num_layers` blocks. Its gap's
  inputs, X_pre entering block i and X_post entering block i+n, are both block inputs of the dense model,
  so one dense pass collects every candidate's statistics (statistics are sums over tokens); in chunks of
  `repair_chunk` candidates when they do not fit in memory at once.
- `greedy.repair_greedy_plan` (``criterion: repair_greedy``): one block at a time, any block.
- `fitting.RepairFitter`: the statistics and fits with their caches; `scoring.SelectionScorer`: the KL.
"""

from ..criteria import first_windows
from .fitting import RepairFitter, repair_config
from .greedy import repair_greedy_plan
from .repair import Runs, repair_plan, score_runs
from .scoring import SelectionScorer

__all__ = [
    "RepairFitter",
    "Runs",
    "SelectionScorer",
    "choose_repaired",
    "repair_config",
    "repair_greedy_plan",
    "repair_plan",
    "score_runs",
]


def choose_repaired(plan_cfg, recovery, model, stack, batches, selection, progress=lambda it, desc: it, taken=()):
    """The plan of a repair-aware criterion (`plan_cfg.criterion` ``repair`` or ``repair_greedy``; `taken`:
    the steps of an earlier ``repair_greedy`` search of these settings, its first)."""
    cfg = repair_config(plan_cfg, recovery)
    if not selection:
        raise ValueError(
            f"plan.criterion {plan_cfg.criterion!r} scores each repaired candidate on held-out windows, and "
            "there are none: set data.selection (a source and num_windows, disjoint from calibration and "
            "evaluation)"
        )
    if plan_cfg.criterion_samples is not None:
        # The candidates' statistics from the first windows only (the chosen plan's fits read them all).
        batches = list(first_windows(batches, plan_cfg.criterion_samples))
    if plan_cfg.criterion == "repair":
        return repair_plan(plan_cfg, cfg, model, stack, batches, selection, progress)
    return repair_greedy_plan(plan_cfg, cfg, model, stack, batches, selection, progress, taken)
