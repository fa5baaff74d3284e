"""Calibration over several processes: each rank streams its share of the windows, and the statistics,
which are sums, are added across ranks before the solve, so every rank solves the same operators as a
single process would (to float64 round-off in the order of the additions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..methods import Collector

T = TypeVar("T")
Reduce = Callable[[torch.Tensor], torch.Tensor]


def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s share of `items`: every `world`-th one, starting at `rank`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    return list(items[rank::world])


def sum_state(state: dict, reduce: Reduce) -> dict:
    """The same nested state with every tensor and integer replaced by its sum over ranks."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = sum_state(value, reduce)
        elif isinstance(value, torch.Tensor):
            out[key] = reduce(value.clone())
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = int(reduce(torch.tensor(value, dtype=torch.float64)).item())
        else:
            out[key] = value
    return out


def sum_collectors(collectors: dict[str, Collector], reduce: Reduce) -> None:
    """Replace each collector's sums by their totals over ranks, in place."""
    for collector in collectors.values():
        collector.load_state_dict(sum_state(collector.state_dict(), reduce))
