"""Which blocks a criterion may remove: protected edges, candidate runs and blocks, window caps; and
`PerBlock`, the criteria that score each block alone and remove the lowest."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..core.model import DecoderStack
from ..core.plan import PruningPlan
from .interface import Batch, Criterion, PlanConfig, PlanInputs


def _protection(keep_first: int, keep_last: int) -> str:
    return f"keeping the first {keep_first} and last {keep_last}; " if keep_first or keep_last else ""


def protected_edges(cfg: PlanConfig) -> tuple[int, int]:
    """(keep_first, keep_last) that a criterion must respect: `allow_edges` means (0, 0)."""
    if cfg.allow_edges:
        # The defaults (1, 1) cannot be told from an explicit 1/1, so only a clear contradiction fails.
        if (cfg.keep_first, cfg.keep_last) not in ((1, 1), (0, 0)):
            raise ValueError(
                f"plan.allow_edges=true lets a criterion remove any block, but plan.keep_first="
                f"{cfg.keep_first} and plan.keep_last={cfg.keep_last} protect some: set one or the other"
            )
        return 0, 0
    return cfg.keep_first, cfg.keep_last


def candidate_starts(num_layers: int, n: int, *, keep_first: int = 1, keep_last: int = 1) -> list[int]:
    """Start indices i of contiguous blocks [i, i+n) that a criterion may remove: the `keep_first` and
    `keep_last` blocks at either end are never part of a candidate."""
    lo, hi = keep_first, num_layers - keep_last - n
    most = min(num_layers - keep_first - keep_last, num_layers - 1)
    if n < 1 or n > most or hi < lo:
        raise ValueError(
            f"cannot remove {n} contiguous layers from {num_layers} "
            f"({_protection(keep_first, keep_last)}at most {max(most, 0)} can go)"
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


def first_windows(batches: Iterable[Batch], limit: int | None) -> Iterator[Batch]:
    """The batches cut down to the first `limit` windows (rows) in all (every batch when None), stopping as soon
    as the limit is reached so that an expensive loader is not drained."""
    if limit is None:
        yield from batches
        return
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


@dataclass(frozen=True)
class PerBlock(Criterion):
    """A criterion that scores every removable block on its own (`score(model, stack, batches, blocks)`:
    {block: score}, lower is less important) and removes the `num_layers` lowest, wherever they are."""

    name: str
    score: Callable[[nn.Module, DecoderStack, Iterable[Batch], list[int]], dict[int, float]]
    costly: bool = False

    def choose(self, cfg: PlanConfig, inputs: PlanInputs) -> PruningPlan:
        n, num_layers = cfg.num_layers, len(inputs.stack.layers)
        keep_first, keep_last = protected_edges(cfg)
        blocks = candidate_blocks(num_layers, n, keep_first, keep_last)
        batches = inputs.progress(inputs.batches, f"criterion {self.name}")
        if self.costly:
            batches = first_windows(batches, cfg.criterion_samples)
        per_block = self.score(inputs.model, inputs.stack, batches, blocks)
        return PruningPlan.from_layers(
            # The `n` lowest, in order; ties (identity blocks score exactly alike) go to the earlier block.
            sorted(sorted(per_block, key=lambda i: (per_block[i], i))[:n]),
            num_layers,
            # The criterion already kept the protected blocks; from_layers only has to accept edges it may take.
            allow_edges=keep_first == 0 or keep_last == 0,
            chosen_by=self.name,
            scores={str(i): s for i, s in per_block.items()},
        )
