"""Streaming calibration: residual streams at the gap boundaries → every method's per-gap statistics.

Nothing but fixed-size float64 accumulators is kept, so memory does not grow with the number of
samples, and each forward pass stops at the last block whose input is needed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from ..core.capture import gap_points, residual_streams
from ..core.model import DecoderStack, model_inputs
from ..core.plan import Gap
from ..core.views import DENSE, PrunedModel
from ..methods import Collector, GapTaps, needs_mlp


@torch.no_grad()
def accumulate(
    model: nn.Module,
    stack: DecoderStack,
    gaps: list[Gap],
    batches: Iterable[dict[str, torch.Tensor]],
    stats: dict[str, dict[str, Collector]],
) -> int:
    """Stream batches through the dense model and feed each gap's taps to its collectors.

    Every gap sees the dense model's own activations (the independent fit). Returns tokens seen.
    """
    points = gap_points(gaps)
    mlp_blocks = sorted({g.start - 1 for g in gaps if g.start > 0 and needs_mlp(stats[g.key])})
    tokens = 0
    for batch in batches:
        ids, mask = model_inputs(model, batch)
        mlp: dict[int, torch.Tensor] = {}
        streams, first = residual_streams(model, stack, ids, mask, points, mlp_blocks, mlp)
        for gap in gaps:
            taps = GapTaps(streams[gap.start], streams[gap.stop], mask, first, mlp.get(gap.start - 1))
            for collector in stats[gap.key].values():
                collector.update(taps)
        tokens += int(mask.sum())
    return tokens


@torch.no_grad()
def accumulate_students(
    pruned: PrunedModel,
    gap: Gap,
    batches: Iterable[dict[str, torch.Tensor]],
    collectors: dict[str, dict[str, Collector]],
) -> dict[str, float]:
    """Sequential fit: X_pre is what the pruned student (earlier gaps already repaired by a view) really
    feeds this gap; X_post is still the dense model's.

    `collectors` maps each view to the collectors it feeds. The dense forward is shared by every view:
    per batch one dense pass, then one pass per view, all stopping early. Returns the seconds spent in
    the dense passes (``"dense"``) and in each view's passes, so callers can report per-method costs.
    """
    kept = pruned.plan.kept
    student_point = kept.index(gap.stop) if gap.stop < pruned.plan.num_layers else len(kept)
    mlp_blocks = {
        view: [kept.index(gap.start - 1)] if gap.start > 0 and needs_mlp(c) else [] for view, c in collectors.items()
    }
    seconds = dict.fromkeys([DENSE, *collectors], 0.0)
    for batch in batches:
        start = time.perf_counter()
        ids, mask = model_inputs(pruned.model, batch)
        with pruned.use(DENSE):
            dense, _ = residual_streams(pruned.model, pruned.stack, ids, mask, [gap.stop])
        seconds[DENSE] += time.perf_counter() - start
        for view, view_collectors in collectors.items():
            start = time.perf_counter()
            mlp: dict[int, torch.Tensor] = {}
            with pruned.use(view):
                student, first = residual_streams(
                    pruned.model, pruned.stack, ids, mask, [student_point], mlp_blocks[view], mlp
                )
            taps = GapTaps(student[student_point], dense[gap.stop], mask, first, next(iter(mlp.values()), None))
            for collector in view_collectors.values():
                collector.update(taps)
            seconds[view] += time.perf_counter() - start
    return seconds
