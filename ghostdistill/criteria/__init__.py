"""Criteria that choose which blocks to remove from calibration data.

Contiguous criteria score every run of `n` blocks at once: ``streamline`` (cosine between the run's
input and output), ``angular`` and ``angular_last`` (Gromov et al. 2024, "The Unreasonable
Ineffectiveness of the Deeper Layers"). Per-block criteria score each block on its own and remove the
`n` least important, wherever they are:

- ``block_influence``: ShortGPT (Men et al. 2024, "ShortGPT: Layers in Large Language Models are More
  Redundant Than You Expect"), BI_i = 1 - cos(input of block i, output of block i).
- ``ppl`` and ``taylor``: Shortened LLaMA (Kim et al. 2024, "Shortened LLaMA: Depth Pruning for Large
  Language Models with Comparison of Retraining Methods"): the perplexity of the model without block i,
  and the first-order Taylor importance sum |W * dL/dW| over the block's weights.

All similarity criteria compare hidden vectors along the channel axis, per token, with padding masked,
and are accumulated over batches (one forward pass, every candidate block at once). `keep_first` and
`keep_last` protect the first and last blocks from every criterion.

The repair-aware criteria ``repair`` (contiguous) and ``repair_greedy`` (any blocks) fit a repair for
every candidate and score the repaired model; they live above the methods and the calibration pass, in
`ghostdistill.planning`, and `check_plan` checks their candidate counts like the others'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import get_args

from torch import nn

from ..core.model import DecoderStack
from ..core.plan import REPAIR_CRITERIA, CriterionName, PlanConfig, PruningPlan
from .candidates import Batch, candidate_blocks, candidate_starts, first_windows, protected_edges
from .perplexity import removal_perplexity
from .similarity import block_influence, block_similarity
from .taylor import taylor_importance

CRITERIA: tuple[str, ...] = get_args(CriterionName)
CONTIGUOUS_CRITERIA = ("streamline", "angular", "angular_last", "repair")
# Criteria whose cost grows with the data by more than one forward pass per batch: `criterion_samples`
# caps the windows they see.
COSTLY_CRITERIA = ("ppl", "taylor")

__all__ = [
    "CRITERIA",
    "block_influence",
    "block_similarity",
    "candidate_blocks",
    "candidate_starts",
    "check_plan",
    "choose_plan",
    "first_windows",
    "protected_edges",
    "removal_perplexity",
    "taylor_importance",
]


def _lowest(scores: dict[int, float], n: int) -> list[int]:
    # Ties (several identity blocks score exactly alike) go to the earlier block, deterministically.
    return sorted(sorted(scores, key=lambda i: (scores[i], i))[:n])


def check_plan(cfg: PlanConfig, num_layers: int) -> PruningPlan | None:
    """Everything about the plan that the model's depth decides, before any data is read: the explicit plan
    (out-of-range or edge layers, removing them all), or whether `cfg.criterion` may remove `cfg.num_layers`
    of `num_layers` blocks with its protected edges. Returns the explicit plan, or None for a criterion."""
    cfg.validate()
    if cfg.layers is not None:
        return PruningPlan.from_layers(cfg.layers, num_layers, allow_edges=cfg.allow_edges)
    if cfg.criterion not in CRITERIA:
        raise ValueError(f"plan.criterion {cfg.criterion!r} is not known; choose one of {', '.join(CRITERIA)}")
    keep_first, keep_last = protected_edges(cfg)
    try:
        if cfg.criterion in CONTIGUOUS_CRITERIA:
            candidate_starts(num_layers, cfg.num_layers, keep_first=keep_first, keep_last=keep_last)
        else:
            candidate_blocks(num_layers, cfg.num_layers, keep_first, keep_last)
    except ValueError as err:
        raise ValueError(f"plan.num_layers {cfg.num_layers} with plan.criterion {cfg.criterion!r}: {err}") from None
    return None


def choose_plan(cfg: PlanConfig, model: nn.Module, stack: DecoderStack, batches: Iterable[Batch]) -> PruningPlan:
    """Pick the blocks to remove with `cfg.criterion`.

    Contiguous run of `cfg.num_layers`: highest cosine (``streamline``) or lowest angular distance
    (``angular``, ``angular_last``; Gromov et al. 2024). Any `cfg.num_layers` blocks with the lowest
    per-block score: ShortGPT's Block Influence (``block_influence``; Men et al. 2024), or Shortened
    LLaMA's perplexity without the block (``ppl``) or Taylor importance (``taylor``; Kim et al. 2024).
    Scores land in `PruningPlan.scores`, keyed "i-j" for runs and "i" for single blocks.
    """
    criterion = cfg.criterion
    if criterion in REPAIR_CRITERIA:
        raise ValueError(
            f"plan.criterion {criterion!r} fits a repair for every candidate: it needs the recovery entries and "
            "selection windows, so choose it with ghostdistill.planning.choose_repaired (pipeline.calibrate.choose)"
        )
    if criterion not in CRITERIA:
        raise ValueError(f"plan.criterion {criterion!r} is not known; choose one of {', '.join(CRITERIA)}")
    if cfg.num_layers is None:
        raise ValueError(f"plan.criterion={criterion!r} needs plan.num_layers (how many layers to remove)")
    if cfg.criterion_samples is not None and cfg.criterion_samples < 1:
        raise ValueError(f"plan.criterion_samples must be >= 1 (or unset for all), got {cfg.criterion_samples}")
    num_layers = len(stack.layers)
    n = cfg.num_layers
    keep_first, keep_last = protected_edges(cfg)
    # The criterion already kept the protected blocks; from_layers only has to accept edges it may take.
    allow_edges = keep_first == 0 or keep_last == 0

    if criterion in CONTIGUOUS_CRITERIA:
        scores = block_similarity(
            model,
            stack,
            batches,
            n,
            last_token_only=criterion == "angular_last",
            keep_first=keep_first,
            keep_last=keep_last,
        )
        if criterion == "streamline":
            best = max(scores, key=lambda i: scores[i]["cosine"])
            table = {f"{i}-{i + n - 1}": s["cosine"] for i, s in scores.items()}
        else:
            best = min(scores, key=lambda i: scores[i]["angular"])
            table = {f"{i}-{i + n - 1}": s["angular"] for i, s in scores.items()}
        removed = list(range(best, best + n))
    else:
        blocks = candidate_blocks(num_layers, n, keep_first, keep_last)
        if criterion in COSTLY_CRITERIA:
            batches = first_windows(batches, cfg.criterion_samples)
        score_fn = {"block_influence": block_influence, "ppl": removal_perplexity, "taylor": taylor_importance}
        per_block = score_fn[criterion](model, stack, batches, blocks)
        removed = _lowest(per_block, n)
        table = {str(i): s for i, s in per_block.items()}
    return PruningPlan.from_layers(removed, num_layers, allow_edges=allow_edges, chosen_by=criterion, scores=table)
