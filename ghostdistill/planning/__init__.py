"""Planning: which blocks to remove. One package, one registry of criteria (`interface.py`: `PlanConfig`,
`PlanInputs`, the `Criterion` base class, `register`), one module per family of criteria:

| criterion | removes | module |
|---|---|---|
| ``streamline``, ``angular``, ``angular_last`` | the most similar run of `num_layers` blocks | `similarity.py` |
| ``block_influence`` | the blocks that change the stream least (ShortGPT) | `similarity.py` |
| ``ppl`` | the blocks whose removal costs the least perplexity (Shortened LLaMA) | `perplexity.py` |
| ``taylor`` | the blocks of least Σ|W·∂L/∂W| (Shortened LLaMA) | `taylor.py` |
| ``repair`` | the run whose *repaired* model is closest to the dense one | `repair.py` |
| ``repair_greedy`` | one block at a time, any block, by the same score | `greedy.py` |

    check_plan(cfg, num_layers)           before any data: the explicit plan, or the candidate counts
    check_plan_depth(cfg, model)          the same before the model loads, its depth read from its config
    check_selection(data, who)            a repair-aware criterion has held-out windows to score on
    greedy_steps(cfg, fingerprint_at)     `plan.greedy_from`'s steps, checked by fingerprint
    choose(cfg, model, batches, ...)      the plan: the explicit list, or the criterion's choice

Adding a criterion: one module defining a `Criterion` (its members, defaults on the base class), passed to
`register` (a taken name is refused, naming both), and for a shipped one its name in the import line below (`PerBlock` in `candidates.py` makes a per-block one from a score
function). A run's `plan.criterion` is checked against the registry when the config is made.

The pre-repair criteria
-----------------------
Contiguous criteria score every run of `n` blocks at once: ``streamline`` (cosine between the run's
input and output), ``angular`` and ``angular_last`` (Gromov et al. 2024, "The Unreasonable
Ineffectiveness of the Deeper Layers"). Per-block criteria score each block on its own and remove the
`n` least important, wherever they are:

- ``block_influence``: ShortGPT (Men et al. 2024, "ShortGPT: Layers in Large Language Models are More
  Redundant Than You Expect"), BI_i = 1 - cos(input of block i, output of block i).
- ``ppl`` and ``taylor``: Shortened LLaMA (Kim et al. 2024, "Shortened LLaMA: Depth Pruning for Large
  Language Models with Comparison of Retraining Methods"): the perplexity of the model without block i,
  and the first-order Taylor importance sum |W * dL/dW| over the block's weights.

How the similarity criteria compare the stream: `similarity.py`. `keep_first` and `keep_last` protect the
first and last blocks from every criterion.

The repair-aware criteria
-------------------------
The pre-repair criteria (above) rank blocks by how little the residual stream changes
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

- `repair.repair_plan` (``criterion: repair``): every contiguous run of `num_layers` blocks, their statistics
  from one dense pass (or one per chunk of `repair_chunk` candidates; why one pass serves them all: `fitting`).
- `greedy.repair_greedy_plan` (``criterion: repair_greedy``): one block at a time, any block.
- `fitting.RepairFitter`: the statistics and fits with their caches; `scoring.SelectionScorer`: the KL.

The repair-aware plan's candidates are written into results.md by `ghostdistill.reporting.planning`: this
package decides, reporting presents (it sits above every phase and writes files).
"""

from __future__ import annotations

from torch import nn

from ..core.model import ModelConfig, decoder_stack, model_depth
from ..core.plan import PruningPlan
from ..data.sources import GENERATE
from ..methods import RecoveryConfig

# The registry, in the order of the table above (`criteria()` and error messages list them so).
# isort: off
from . import similarity, perplexity, taylor, repair, greedy  # noqa: F401

# isort: on
from .candidates import PerBlock, candidate_blocks, candidate_starts, protected_edges
from .fitting import RepairFitter, repair_config
from .greedy import greedy_steps, repair_greedy_plan
from .interface import (
    Batch,
    Criterion,
    PlanConfig,
    PlanInputs,
    Progress,
    criteria,
    get_criterion,
    no_progress,
    register,
    unregister,
)
from .perplexity import removal_perplexity
from .repair import repair_plan, score_runs
from .scoring import SelectionScorer
from .similarity import block_influence, block_similarity

__all__ = [
    "Criterion",
    "PerBlock",
    "PlanConfig",
    "PlanInputs",
    "Progress",
    "RepairFitter",
    "SelectionScorer",
    "block_influence",
    "block_similarity",
    "candidate_blocks",
    "candidate_starts",
    "check_plan",
    "check_plan_depth",
    "check_selection",
    "choose",
    "criteria",
    "greedy_steps",
    "no_progress",
    "protected_edges",
    "register",
    "removal_perplexity",
    "repair_config",
    "repair_greedy_plan",
    "repair_plan",
    "score_runs",
    "unregister",
]


def check_plan(cfg: PlanConfig, num_layers: int) -> PruningPlan | None:
    """Everything about the plan that the model's depth decides, before any data is read: the explicit plan
    (out-of-range or edge layers, removing them all), or whether `cfg.criterion` may remove `cfg.num_layers`
    of `num_layers` blocks with its protected edges. Returns the explicit plan, or None for a criterion."""
    cfg.validate()
    if cfg.layers is not None:
        return PruningPlan.from_layers(cfg.layers, num_layers, allow_edges=cfg.allow_edges)
    candidates = candidate_starts if get_criterion(cfg.criterion).contiguous else candidate_blocks
    keep_first, keep_last = protected_edges(cfg)
    try:
        candidates(num_layers, cfg.num_layers, keep_first=keep_first, keep_last=keep_last)
    except ValueError as err:
        raise ValueError(f"plan.num_layers {cfg.num_layers} with plan.criterion {cfg.criterion!r}: {err}") from None
    return None


def check_plan_depth(cfg: PlanConfig, model: ModelConfig) -> None:
    """`check_plan` against the depth in the model's config (`core.model.model_depth`: no weights), before a run
    folder is made or the model loads; nothing when the config cannot tell (the check after the load decides)."""
    depth = model_depth(model)
    if depth is not None:
        check_plan(cfg, depth)


def check_selection(data, who: str) -> None:
    """The repair-aware plans are scored on held-out windows: a text calibration source needs
    `data.selection.source` (self-generated calibration generates them). `data`: the run's data sections."""
    if data.selection.source is None and data.calibration.source.source != GENERATE:
        raise ValueError(
            f"{who} scores every repaired candidate on held-out windows: set data.selection.source "
            "(disjoint from calibration and evaluation, e.g. the calibration text's later documents with "
            "first_document)"
        )


def choose(
    cfg: PlanConfig,
    model: nn.Module,
    batches: list[Batch],
    progress: Progress = no_progress,
    *,
    recovery: list[RecoveryConfig] | None = None,
    selection: list[Batch] | None = None,
    taken: list[dict] | None = None,
) -> PruningPlan:
    """The layers to remove: the explicit list, or the criterion's choice on the calibration batches (the
    repair-aware criteria also fit `recovery`'s repair method per candidate and score it on `selection`;
    `taken`: ``repair_greedy``'s steps from `plan.greedy_from`, `greedy_steps`). A criterion's plan holds its
    scores (`PruningPlan.scores`), keyed "i-j" for runs and "i" for single blocks."""
    stack = decoder_stack(model)
    explicit = check_plan(cfg, len(stack.layers))
    if explicit is not None:
        return explicit
    inputs = PlanInputs(model, stack, batches, progress, recovery or (), selection, taken or ())
    return get_criterion(cfg.criterion).choose(cfg, inputs)
