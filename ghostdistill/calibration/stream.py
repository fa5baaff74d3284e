"""Streaming calibration: residual streams at the gap boundaries → every method's per-gap statistics.

Nothing but fixed-size float64 accumulators is kept, so memory does not grow with the number of
samples, and each forward pass stops at the last block whose input is needed.

A batch's `statistics_mask` (chat calibration with ``chat.tokens: answers``, `data.chat`) narrows the tokens
the statistics sum over (`GapTaps.mask`) to the ones it marks; the forward still sees every token.

Every tap is checked to be finite before it reaches a sum: one inf or NaN (a float16 model overflowing,
broken weights) would turn every operator into NaN silently, so the run stops at once naming the batch
and the block whose input it was.

How the batches go through the blocks is the model's executor's choice (`core.executor`); either way a gap's
collectors are fed, batch after batch, once the pass reaches its end, so the sums are the same to the bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..core.capture import gap_points
from ..core.executor import executor_of, gap_pairs
from ..core.model import DecoderStack
from ..core.plan import Gap
from ..core.views import DENSE, PrunedModel
from ..methods import Collector, GapTaps, needs_mlp
from .distributed import counted


@torch.no_grad()
def accumulate(
    model: nn.Module,
    stack: DecoderStack,
    gaps: list[Gap],
    batches: Iterable[dict[str, torch.Tensor]],
    stats: dict[str, dict[str, Collector]],
    first_batch: int = 0,
    progress=None,
) -> int:
    """Stream batches through the dense model and feed each gap's taps to its collectors.

    Every gap sees the dense model's own activations (the independent fit). Returns tokens seen.
    `first_batch`: the calibration index of the first batch (for error messages); `progress`: wraps the
    blocks of a block-by-block pass.
    """
    mlp_blocks = sorted({g.start - 1 for g in gaps if g.start > 0 and needs_mlp(stats[g.key])})
    batches = batches if isinstance(batches, list) else list(batches)
    tokens = 0
    pairs = [(g.start, g.stop) for g in gaps]
    desc = "calibration statistics, block by block"
    reached = executor_of(model).dense_points(model, stack, batches, gap_points(gaps), mlp_blocks, progress, desc)
    for windows, k, before, after, mlp in gap_pairs(_finite(reached, batches, first_batch, model), pairs):
        gap, start = gaps[k], gaps[k].start
        for b, (mask, first) in enumerate(zip(windows.masks, windows.first)):
            batch = batches[windows.offset + b]
            if not counted(batch):  # a padding batch: run (sharded blocks gather in lockstep), not counted
                continue
            out = mlp[start - 1][b] if start - 1 in mlp else None
            if out is not None:
                where = f"calibration batch {first_batch + windows.offset + b}"
                check_finite(out, mask, where, f"the MLP output of block {start - 1}", model)
            summed = counted_tokens(batch, mask)
            tokens += int(summed.sum()) if k == 0 else 0
            for collector in stats[gap.key].values():
                collector.update(GapTaps(before[b], after[b], summed, first, out))
    return tokens


def _finite(reached, batches, first_batch, model):
    """`reached` with every counted batch's stream checked finite at each point (`check_finite`)."""
    for windows, point, streams, mlp in reached:
        for b, (stream, mask) in enumerate(zip(streams, windows.masks)):
            if counted(batches[windows.offset + b]):
                where = f"calibration batch {first_batch + windows.offset + b}"
                check_finite(stream, mask, where, f"the residual stream entering block {point}", model)
        yield windows, point, streams, mlp


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
    before = [kept.index(gap.start - 1)] if gap.start > 0 else []  # the block before the gap, in the student
    runs = [(DENSE, gap.stop, []), *((v, student_point, before if needs_mlp(c) else []) for v, c in collectors.items())]
    seconds = dict.fromkeys([DENSE, *collectors], 0.0)
    batches = batches if isinstance(batches, list) else list(batches)
    desc = f"student statistics for gap {gap.key}, block by block"
    for windows, taps, mlp, spent in executor_of(pruned.model).view_points(pruned, batches, runs, desc):
        for name, s in zip(seconds, spent):
            seconds[name] += s
        for b, (mask, first) in enumerate(zip(windows.masks, windows.first)):
            batch = batches[windows.offset + b]
            if not counted(batch):
                continue
            summed = counted_tokens(batch, mask)
            for i, (view, view_collectors) in enumerate(collectors.items(), start=1):
                where = f"student statistics of view {view!r}, gap {gap.key}, batch {windows.offset + b}"
                check_finite(taps[i][b], mask, where, f"the residual stream entering block {gap.stop}", pruned.model)
                out = next(iter(mlp[i].values()))[b] if mlp[i] else None
                for collector in view_collectors.values():
                    collector.update(GapTaps(taps[i][b], taps[0][b], summed, first, out))
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
