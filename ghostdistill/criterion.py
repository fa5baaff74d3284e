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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import get_args

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import model_inputs, residual_streams
from .model import DecoderStack
from .plan import CriterionName, PlanConfig, PruningPlan
from .pruning import PRUNED, PrunedModel

CRITERIA: tuple[str, ...] = get_args(CriterionName)
CONTIGUOUS_CRITERIA = ("streamline", "angular", "angular_last")
# Criteria whose cost grows with the data by more than one forward pass per batch: `criterion_samples`
# caps the windows they see.
COSTLY_CRITERIA = ("ppl", "taylor")

Batch = dict[str, torch.Tensor]

# Positions per chunk when turning logits into log-probabilities: float32 log-probs of a whole batch
# over a 128k vocabulary would take gigabytes.
_LOGIT_CHUNK = 1024


def _edge_counts(allow_edges: bool, keep_first: int | None, keep_last: int | None) -> tuple[int, int]:
    default = 0 if allow_edges else 1
    return (default if keep_first is None else keep_first, default if keep_last is None else keep_last)


def _protection(keep_first: int, keep_last: int) -> str:
    return f"keeping the first {keep_first} and last {keep_last}; " if keep_first or keep_last else ""


def protected_edges(cfg: PlanConfig) -> tuple[int, int]:
    """(keep_first, keep_last) that a criterion must respect: `allow_edges` means (0, 0)."""
    if cfg.keep_first < 0 or cfg.keep_last < 0:
        raise ValueError(
            f"plan.keep_first and plan.keep_last must be >= 0, got {cfg.keep_first} and {cfg.keep_last}"
        )
    if cfg.allow_edges:
        # The defaults (1, 1) cannot be told from an explicit 1/1, so only a clear contradiction fails.
        if (cfg.keep_first, cfg.keep_last) not in ((1, 1), (0, 0)):
            raise ValueError(
                f"plan.allow_edges=true lets a criterion remove any block, but plan.keep_first="
                f"{cfg.keep_first} and plan.keep_last={cfg.keep_last} protect some: set one or the other"
            )
        return 0, 0
    return cfg.keep_first, cfg.keep_last


def candidate_starts(
    num_layers: int,
    n: int,
    allow_edges: bool = False,
    *,
    keep_first: int | None = None,
    keep_last: int | None = None,
) -> list[int]:
    """Start indices i of contiguous blocks [i, i+n) that a criterion may remove.

    `keep_first`/`keep_last` (default: 1 each, 0 each with `allow_edges`) blocks at either end are
    never part of a candidate."""
    first, last = _edge_counts(allow_edges, keep_first, keep_last)
    lo, hi = first, num_layers - last - n
    most = min(num_layers - first - last, num_layers - 1)
    if n < 1 or n > most or hi < lo:
        raise ValueError(
            f"cannot remove {n} contiguous layers from {num_layers} "
            f"({_protection(first, last)}at most {max(most, 0)} can go)"
        )
    return list(range(lo, hi + 1))


def candidate_blocks(num_layers: int, n: int, keep_first: int, keep_last: int) -> list[int]:
    """Blocks a per-block criterion may remove, checking that `n` of them can go."""
    blocks = list(range(keep_first, num_layers - keep_last))
    most = min(len(blocks), num_layers - 1)
    if n < 1 or n > most:
        raise ValueError(
            f"cannot remove {n} layers from {num_layers} ({_protection(keep_first, keep_last)}"
            f"{len(blocks)} are removable, at most {max(most, 0)} can go)"
        )
    return blocks


def _token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity along the channel axis for every token, computed in float32."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-8)


def first_windows(batches: Iterable[Batch], limit: int | None) -> Iterator[Batch]:
    """The batches cut down to the first `limit` windows (rows) in all; every batch when None.

    Stops iterating as soon as the limit is reached, so an expensive loader is not drained."""
    if limit is None:
        yield from batches
        return
    if limit < 1:
        raise ValueError(f"plan.criterion_samples must be >= 1, got {limit}")
    left = limit
    for batch in batches:
        rows = batch["input_ids"].shape[0]
        if rows > left:
            batch = {
                k: v[:left] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v
                for k, v in batch.items()
            }
        yield batch
        left -= min(rows, left)
        if left == 0:
            return


def _next_token_nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy (float32) over positions whose token and target are both real."""
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    pred, target = logits[:, :-1], ids[:, 1:]
    rows, positions = target.shape
    step = max(1, _LOGIT_CHUNK // rows)
    total = logits.new_zeros((), dtype=torch.float32)
    # Slices of positions rather than `logits[valid]`, which would copy the whole logits tensor at once.
    for lo in range(0, positions, step):
        chunk = pred[:, lo : lo + step].float()
        nll = F.cross_entropy(chunk.flatten(0, 1), target[:, lo : lo + step].flatten(), reduction="none")
        total = total + torch.where(valid[:, lo : lo + step].flatten(), nll, 0.0).sum()
    return total, int(valid.sum())


@torch.no_grad()
def block_similarity(
    model: nn.Module,
    stack: DecoderStack,
    batches: Iterable[Batch],
    n: int,
    *,
    allow_edges: bool = False,
    last_token_only: bool = False,
    keep_first: int | None = None,
    keep_last: int | None = None,
) -> dict[int, dict[str, float]]:
    """For every candidate block [i, i+n): mean cosine and mean angular distance between the residual
    stream entering block i and the one leaving block i+n-1, over non-padding tokens (or over the last
    non-padding token of each sequence)."""
    num_layers = len(stack.layers)
    starts = candidate_starts(num_layers, n, allow_edges, keep_first=keep_first, keep_last=keep_last)
    points = sorted({p for i in starts for p in (i, i + n)})
    cos_sum = {i: 0.0 for i in starts}
    ang_sum = {i: 0.0 for i in starts}
    count = 0
    for batch in batches:
        ids, mask = model_inputs(model, batch)
        streams, _ = residual_streams(model, stack, ids, mask, points)
        if last_token_only:
            last = mask.sum(1) - 1
            select = torch.zeros_like(mask, dtype=torch.bool)
            select[torch.arange(ids.shape[0], device=ids.device), last] = True
        else:
            select = mask.bool()
        count += int(select.sum())
        for i in starts:
            cos = _token_cosine(streams[i], streams[i + n])[select].double()
            cos_sum[i] += float(cos.sum())
            ang_sum[i] += float((torch.arccos(cos.clamp(-1, 1)) / math.pi).sum())
    if count == 0:
        raise ValueError("the criterion saw no tokens: the calibration data is empty")
    return {i: {"cosine": cos_sum[i] / count, "angular": ang_sum[i] / count} for i in starts}


@torch.no_grad()
def block_influence(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """ShortGPT's Block Influence (Men et al. 2024): BI_i = 1 - mean over non-padding tokens of the cosine
    between the residual stream entering block i and the one leaving it. Low BI: the block barely
    rotates the stream. One forward pass per batch for all blocks."""
    points = sorted({p for i in blocks for p in (i, i + 1)})
    cos_sum = {i: 0.0 for i in blocks}
    count = 0
    for batch in batches:
        ids, mask = model_inputs(model, batch)
        streams, _ = residual_streams(model, stack, ids, mask, points)
        select = mask.bool()
        count += int(select.sum())
        for i in blocks:
            cos_sum[i] += float(_token_cosine(streams[i], streams[i + 1])[select].double().sum())
    if count == 0:
        raise ValueError("the criterion saw no tokens: the calibration data is empty")
    return {i: 1.0 - cos_sum[i] / count for i in blocks}


@torch.no_grad()
def removal_perplexity(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """Shortened LLaMA's PPL criterion (Kim et al. 2024): for each block, the perplexity on the batches of
    the model with only that block removed. One forward pass per block per batch; the model's layers,
    config and `layer_idx` are restored afterwards, even on error."""
    num_layers = len(stack.layers)
    views: dict[int, PrunedModel] = {}
    nll = {i: 0.0 for i in blocks}
    tokens = 0
    try:
        for i in blocks:
            views[i] = PrunedModel(model, PruningPlan.from_layers([i], num_layers, allow_edges=True))
        for batch in batches:
            ids, mask = model_inputs(model, batch)
            for i in blocks:
                with views[i].use(PRUNED) as pruned:
                    logits = pruned(input_ids=ids, attention_mask=mask, use_cache=False).logits
                total, count = _next_token_nll(logits, ids, mask)
                nll[i] += float(total)
            tokens += count
    finally:
        # Each view hosts (inactive) operator hooks on the dense blocks: leave none behind.
        for view in views.values():
            view.remove_hooks()
    if tokens == 0:
        raise ValueError("the criterion saw no tokens: the calibration data is empty (or one token per window)")
    # Cap the exponent: a wrecked model's perplexity overflows a float, and the ranking only needs order.
    return {i: math.exp(min(nll[i] / tokens, 700.0)) for i in blocks}


def taylor_importance(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """Shortened LLaMA's Taylor criterion (Kim et al. 2024): importance of block i = sum over its
    parameters of |W * dL/dW|, with L the mean next-token cross-entropy over every non-padding token of
    the batches (gradients accumulated over batches before taking the absolute value).

    Only the candidate blocks' parameters get gradients; every parameter's `requires_grad` and `.grad`
    and every module's training flag are put back afterwards, even on error."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("the taylor criterion needs gradients; call it outside torch.inference_mode()")
    params = list(model.parameters())
    saved_flags = [p.requires_grad for p in params]
    saved_grads = [p.grad for p in params]
    saved_training = {m: m.training for m in model.modules()}
    # Parameters shared between blocks (rare) are counted once per block that uses them.
    block_params = {i: list(stack.layers[i].parameters()) for i in blocks}
    tokens = 0
    try:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
        for ps in block_params.values():
            for p in ps:
                p.requires_grad_(True)
        # Dropout would make the gradient noisy; the importance is of the inference-time model.
        model.eval()
        with torch.enable_grad():
            for batch in batches:
                ids, mask = model_inputs(model, batch)
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                total, count = _next_token_nll(logits, ids, mask)
                del logits
                if count:
                    # Summed, not averaged per batch, so that every token weighs the same across batches.
                    total.backward()
                tokens += count
        if tokens == 0:
            raise ValueError("the criterion saw no tokens: the calibration data is empty (or one token per window)")
        with torch.no_grad():
            scores = {
                i: sum(
                    float((p.float() * p.grad.float()).abs().sum(dtype=torch.float64))
                    for p in ps
                    if p.grad is not None
                )
                / tokens
                for i, ps in block_params.items()
            }
    finally:
        for p, flag, grad in zip(params, saved_flags, saved_grads):
            p.grad = grad
            p.requires_grad_(flag)
        for m, training in saved_training.items():
            m.training = training
    return scores


def _lowest(scores: dict[int, float], n: int) -> list[int]:
    # Ties (several identity blocks score exactly alike) go to the earlier block, deterministically.
    return sorted(sorted(scores, key=lambda i: (scores[i], i))[:n])


def choose_plan(cfg: PlanConfig, model: nn.Module, stack: DecoderStack, batches: Iterable[Batch]) -> PruningPlan:
    """Pick the blocks to remove with `cfg.criterion`.

    Contiguous run of `cfg.num_layers`: highest cosine (``streamline``) or lowest angular distance
    (``angular``, ``angular_last``; Gromov et al. 2024). Any `cfg.num_layers` blocks with the lowest
    per-block score: ShortGPT's Block Influence (``block_influence``; Men et al. 2024), or Shortened
    LLaMA's perplexity without the block (``ppl``) or Taylor importance (``taylor``; Kim et al. 2024).
    Scores land in `PruningPlan.scores`, keyed "i-j" for runs and "i" for single blocks.
    """
    criterion = cfg.criterion
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
