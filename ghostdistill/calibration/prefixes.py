"""Statistics for several calibration sizes from one pass: the sums are additive over windows.

Every collector holds sums over tokens, so the statistics of the first n windows are a prefix of the
pass over all of them. `accumulate_prefixes` streams the windows once, in order, in batches that
never straddle a requested size, and hands out a copy of every collector each time a size is reached:
sizes 4, 8, ..., 128 cost one pass over 128 windows instead of 4 + 8 + ... + 128. Used by the
calibration-sensitivity measurement (`scripts/studies/calibration_sensitivity.py`); the copies solve exactly
as a separate pass over those windows would (to float64 rounding in the order of the additions).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from itertools import pairwise

import torch
from torch import nn

from ..core.model import DecoderStack
from ..core.plan import Gap
from ..methods import Collector, RecoveryConfig, make_collectors
from .stream import accumulate

Stats = dict[str, dict[str, Collector]]


def prefix_batches(num_windows: int, sizes: Sequence[int], batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) window ranges of at most `batch_size` windows, cut at every size in `sizes`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if bad := [s for s in sizes if not 0 < s <= num_windows]:
        raise ValueError(f"calibration sizes {bad} are not in 1..{num_windows} (the windows available)")
    cuts = [0, *sorted(set(sizes) | {num_windows})]
    return [(a, min(a + batch_size, cut)) for prev, cut in pairwise(cuts) for a in range(prev, cut, batch_size)]


@torch.no_grad()
def accumulate_prefixes(
    model: nn.Module,
    stack: DecoderStack,
    gaps: list[Gap],
    windows: torch.Tensor,
    sizes: Sequence[int],
    methods: set[str],
    hidden: int,
    device: torch.device | str,
    batch_size: int = 4,
    recovery: list[RecoveryConfig] | None = None,
) -> Iterator[tuple[int, Stats]]:
    """One pass over `windows` (dense model, every gap); yields (n, statistics of the first n windows)
    for each n in `sizes`, ascending. Each yielded set is a copy: later windows do not change it.
    `recovery`: the entries to be fitted, to hold only what they read (`make_collectors`)."""
    stats = {g.key: make_collectors(methods, hidden, device, recovery) for g in gaps}
    for start, stop in prefix_batches(len(windows), sizes, batch_size):
        accumulate(model, stack, gaps, [{"input_ids": windows[start:stop]}], stats)
        if stop in sizes:
            copies = {key: make_collectors(methods, hidden, device, recovery) for key in stats}
            for key, collectors in stats.items():
                for name, c in collectors.items():
                    copies[key][name].load_state_dict(copy.deepcopy(c.state_dict()))
            yield stop, copies
