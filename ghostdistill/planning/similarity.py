"""Similarity criteria from one forward pass per batch: ``streamline``, ``angular``, ``angular_last``
(contiguous runs; Gromov et al. 2024) and ``block_influence`` (single blocks; ShortGPT, Men et al. 2024).
Every similarity compares hidden vectors along the channel axis, per token, with padding masked; each pair
is compared, batch after batch, once the model's executor reaches its end (`core.executor`: a full forward
per batch, or block by block with the weights offloaded): the same sums."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..core.executor import executor_of, gap_pairs
from ..core.model import DecoderStack
from ..core.plan import PruningPlan
from .candidates import PerBlock, candidate_starts, protected_edges
from .interface import Batch, Criterion, PlanConfig, PlanInputs, register


@torch.no_grad()
def _mean_similarity(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], pairs: list[tuple[int, int]], last_token_only=False
) -> dict[int, tuple[float, float]]:
    """Per pair (i, j) of `pairs`, by i: the mean cosine and mean angular distance between the residual stream
    entering block i and the one entering block j, over non-padding tokens (or over the last non-padding token
    of each sequence), each batch compared as the model's executor reaches j (`core.executor`)."""
    starts = [i for i, _ in pairs]
    cos_sum, ang_sum = dict.fromkeys(starts, 0.0), dict.fromkeys(starts, 0.0)
    count = 0
    reached = executor_of(model).dense_points(model, stack, batches, {p for pair in pairs for p in pair})
    for windows, k, before, after, _ in gap_pairs(reached, pairs):
        i = starts[k]
        for a, b, mask in zip(before, after, windows.masks):
            select = mask.bool()
            if last_token_only:
                select = torch.zeros_like(select)
                select[torch.arange(mask.shape[0], device=mask.device), mask.sum(1) - 1] = True
            count += int(select.sum()) if k == 0 else 0
            cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-8)[select].double()
            cos_sum[i] += float(cos.sum())
            ang_sum[i] += float((torch.arccos(cos.clamp(-1, 1)) / math.pi).sum())
    if count == 0:
        raise ValueError("the criterion saw no tokens: the calibration data is empty")
    return {i: (cos_sum[i] / count, ang_sum[i] / count) for i in starts}


def block_similarity(
    model: nn.Module,
    stack: DecoderStack,
    batches: Iterable[Batch],
    n: int,
    *,
    last_token_only: bool = False,
    keep_first: int = 1,
    keep_last: int = 1,
) -> dict[int, dict[str, float]]:
    """For every candidate block [i, i+n): mean cosine and mean angular distance between the residual
    stream entering block i and the one leaving block i+n-1, over non-padding tokens (or over the last
    non-padding token of each sequence)."""
    starts = candidate_starts(len(stack.layers), n, keep_first=keep_first, keep_last=keep_last)
    means = _mean_similarity(model, stack, batches, [(i, i + n) for i in starts], last_token_only)
    return {i: {"cosine": cosine, "angular": angular} for i, (cosine, angular) in means.items()}


def block_influence(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """ShortGPT's Block Influence (Men et al. 2024): BI_i = 1 - mean over non-padding tokens of the cosine
    between the residual stream entering block i and the one leaving it. Low BI: the block barely
    rotates the stream. One forward pass per batch for all blocks."""
    means = _mean_similarity(model, stack, batches, [(i, i + 1) for i in blocks])
    return {i: 1.0 - cosine for i, (cosine, _) in means.items()}


@dataclass(frozen=True)
class RunSimilarity(Criterion):
    """A contiguous criterion: the run of `num_layers` blocks whose input and output are most alike, by
    the highest mean cosine (``streamline``) or the lowest angular distance (``angular``, and
    ``angular_last`` on each sequence's last token only; Gromov et al. 2024)."""

    name: str
    measure: str  # "cosine" (highest wins) or "angular" (lowest wins)
    last_token_only: bool = False
    contiguous = True

    def choose(self, cfg: PlanConfig, inputs: PlanInputs) -> PruningPlan:
        n, num_layers = cfg.num_layers, len(inputs.stack.layers)
        keep_first, keep_last = protected_edges(cfg)
        batches = inputs.progress(inputs.batches, f"criterion {self.name}")
        scores = block_similarity(
            inputs.model,
            inputs.stack,
            batches,
            n,
            last_token_only=self.last_token_only,
            keep_first=keep_first,
            keep_last=keep_last,
        )
        pick = max if self.measure == "cosine" else min
        best = pick(scores, key=lambda i: scores[i][self.measure])
        return PruningPlan.from_layers(
            list(range(best, best + n)),
            num_layers,
            allow_edges=keep_first == 0 or keep_last == 0,
            chosen_by=self.name,
            scores={f"{i}-{i + n - 1}": s[self.measure] for i, s in scores.items()},
        )


register(RunSimilarity("streamline", "cosine"))
register(RunSimilarity("angular", "angular"))
register(RunSimilarity("angular_last", "angular", last_token_only=True))
register(PerBlock("block_influence", block_influence))
