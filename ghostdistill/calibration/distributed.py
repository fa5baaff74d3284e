"""Calibration over several processes: each rank streams its share of the windows, and the statistics,
which are sums, are added across ranks before the solve, so every rank solves the same operators as a
single process would (to float64 round-off in the order of the additions).

Every rank runs the same number of batches (`even_shard`; why: `core.sharded`): a rank with one batch fewer than
the others runs a padding batch that is not counted (`counted`), as evaluation does (`lit.datamodule.EvenShares`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..methods import Collector

Reduce = Callable[[torch.Tensor], torch.Tensor]


def even_shard(batches: Sequence[dict], rank: int, world: int) -> list[dict]:
    """Rank `rank`'s share of `batches` (every `world`-th one, starting at `rank`), padded to ⌈len / world⌉
    with copies of its first batch (or the first batch) marked ``counted: False``, so that every rank runs as
    many forwards."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    if not batches:
        return []
    mine = list(batches[rank::world])
    return mine + [{**(mine or batches)[0], "counted": False}] * (-(-len(batches) // world) - len(mine))


def counted(batch: dict) -> bool:
    """Whether a batch's tokens count (a padding batch of `even_shard` runs but adds nothing)."""
    return batch.get("counted", True) is not False


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
