"""Streaming calibration: residual streams at the gap boundaries → every method's per-gap statistics.

Nothing but fixed-size float64 accumulators is kept, so memory does not grow with the number of
samples, and each forward pass stops at the last block whose input is needed.

A batch's `statistics_mask` (chat calibration with ``chat.tokens: answers``, `data.chat`) narrows the tokens
the statistics sum over (`GapTaps.mask`) to the ones it marks; the forward still sees every token.

Every tap is checked to be finite before it reaches a sum: one inf or NaN (a float16 model overflowing,
broken weights) would turn every operator into NaN silently, so the run stops at once naming the batch
and the block whose input it was.
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
    first_batch: int = 0,
) -> int:
    """Stream batches through the dense model and feed each gap's taps to its collectors.

    Every gap sees the dense model's own activations (the independent fit). Returns tokens seen.
    `first_batch`: the calibration index of the first batch (for error messages).
    """
    points = gap_points(gaps)
    mlp_blocks = sorted({g.start - 1 for g in gaps if g.start > 0 and needs_mlp(stats[g.key])})
    tokens = 0
    for index, batch in enumerate(batches, start=first_batch):
        ids, mask = model_inputs(model, batch)
        mlp: dict[int, torch.Tensor] = {}
        streams, first = residual_streams(model, stack, ids, mask, points, mlp_blocks, mlp)
        for point, stream in streams.items():
            check_finite(
                stream, mask, f"calibration batch {index}", f"the residual stream entering block {point}", model
            )
        for block, out in mlp.items():
            check_finite(out, mask, f"calibration batch {index}", f"the MLP output of block {block}", model)
        counted = counted_tokens(batch, mask)
        for gap in gaps:
            taps = GapTaps(streams[gap.start], streams[gap.stop], counted, first, mlp.get(gap.start - 1))
            for collector in stats[gap.key].values():
                collector.update(taps)
        tokens += int(counted.sum())
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
    for index, batch in enumerate(batches):
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
            where = f"student statistics of view {view!r}, gap {gap.key}, batch {index}"
            check_finite(
                student[student_point], mask, where, f"the residual stream entering block {gap.stop}", pruned.model
            )
            counted = counted_tokens(batch, mask)
            taps = GapTaps(student[student_point], dense[gap.stop], counted, first, next(iter(mlp.values()), None))
            for collector in view_collectors.values():
                collector.update(taps)
            seconds[view] += time.perf_counter() - start
    return seconds


def counted_tokens(batch: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """What the statistics sum over: the real tokens (`mask`), narrowed to `batch["statistics_mask"]` if any."""
    narrow = batch.get("statistics_mask")
    return mask if narrow is None else mask * narrow.to(mask.device, mask.dtype)


def check_finite(x: torch.Tensor, mask: torch.Tensor, where: str, what: str, model: nn.Module) -> None:
    """Raise FloatingPointError naming `where` and `what` when a real (non-padding) position of `x` is not finite."""
    bad = ~torch.isfinite(x).all(dim=-1) & mask.bool()
    if bool(bad.any()):
        rows, cols = torch.nonzero(bad, as_tuple=True)
        dtype = next(model.parameters()).dtype
        raise FloatingPointError(
            f"{where}: {what} is not finite at {int(bad.sum())} token(s) (first: sequence {int(rows[0])}, position "
            f"{int(cols[0])}; model dtype {str(dtype).removeprefix('torch.')}). The statistics would be NaN; stopping. "
            "A float16 model overflowing is the usual cause: use model.model.dtype bfloat16 or float32"
        )
