"""Criteria that choose which blocks to remove from calibration data.

All similarity criteria compare hidden vectors along the channel axis, per token, with padding masked,
and are accumulated over batches (one forward pass, every candidate block at once).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .calibration import residual_streams
from .model import DecoderStack
from .plan import PlanConfig, PruningPlan


def candidate_starts(num_layers: int, n: int, allow_edges: bool) -> list[int]:
    """Start indices i of contiguous blocks [i, i+n) that a criterion may remove."""
    lo, hi = (0, num_layers - n) if allow_edges else (1, num_layers - 1 - n)
    if n < 1 or hi < lo:
        raise ValueError(
            f"cannot remove {n} contiguous layers from {num_layers} "
            f"({'' if allow_edges else 'keeping the first and last; '}at most "
            f"{num_layers - (0 if allow_edges else 2)} can go)"
        )
    return list(range(lo, hi + 1))


def _token_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity along the channel axis for every token, computed in float32."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-8)


@torch.no_grad()
def block_similarity(
    model: nn.Module,
    stack: DecoderStack,
    batches: Iterable[dict[str, torch.Tensor]],
    n: int,
    *,
    allow_edges: bool = False,
    last_token_only: bool = False,
) -> dict[int, dict[str, float]]:
    """For every candidate block [i, i+n): mean cosine and mean angular distance between the residual
    stream entering block i and the one leaving block i+n-1, over non-padding tokens (or over the last
    non-padding token of each sequence)."""
    num_layers = len(stack.layers)
    starts = candidate_starts(num_layers, n, allow_edges)
    points = sorted({p for i in starts for p in (i, i + n)})
    cos_sum = {i: 0.0 for i in starts}
    ang_sum = {i: 0.0 for i in starts}
    count = 0
    for batch in batches:
        device = next(model.parameters()).device
        ids = batch["input_ids"].to(device)
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.to(device)
        streams, _ = residual_streams(model, stack, ids, mask, points)
        if last_token_only:
            last = mask.sum(1) - 1
            select = torch.zeros_like(mask, dtype=torch.bool)
            select[torch.arange(ids.shape[0], device=device), last] = True
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


def choose_plan(
    cfg: PlanConfig, model: nn.Module, stack: DecoderStack, batches: Iterable[dict[str, torch.Tensor]]
) -> PruningPlan:
    """Pick the contiguous block to remove: highest cosine (streamline) or lowest angular distance."""
    num_layers = len(stack.layers)
    if cfg.num_layers is None:
        raise ValueError(f"plan.criterion={cfg.criterion!r} needs plan.num_layers (how many layers to remove)")
    criterion = cfg.criterion
    if criterion not in ("streamline", "angular", "angular_last"):
        raise ValueError(f"plan.criterion {criterion!r} is not known; choose streamline, angular or angular_last")
    scores = block_similarity(
        model, stack, batches, cfg.num_layers, allow_edges=cfg.allow_edges, last_token_only=criterion == "angular_last"
    )
    if criterion == "streamline":
        best = max(scores, key=lambda i: scores[i]["cosine"])
        table = {f"{i}-{i + cfg.num_layers - 1}": s["cosine"] for i, s in scores.items()}
    else:
        best = min(scores, key=lambda i: scores[i]["angular"])
        table = {f"{i}-{i + cfg.num_layers - 1}": s["angular"] for i, s in scores.items()}
    return PruningPlan.from_layers(
        list(range(best, best + cfg.num_layers)),
        num_layers,
        allow_edges=cfg.allow_edges,
        chosen_by=criterion,
        scores=table,
    )
