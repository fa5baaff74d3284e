"""Streaming calibration: residual streams at the gap boundaries → every method's per-gap statistics.

Nothing but fixed-size float64 accumulators is kept, so memory does not grow with the number of
samples, and each forward pass stops at the last block whose input is needed.

A batch's `statistics_mask` (chat calibration with ``chat.tokens: answers``, `data.chat`) narrows the tokens
the statistics sum over (`GapTaps.mask`) to the ones it marks; the forward still sees every token.

Every tap is checked to be finite before it reaches a sum: one inf or NaN (a float16 model overflowing,
broken weights) would turn every operator into NaN silently, so the run stops at once naming the batch
and the block whose input it was.

A model whose weights are off the device (`model.model.offload`) is run block by block instead
(`core.sequential`): all batches through one block before the next, each gap's collectors fed, batch after
batch as above, once the pass has reached its end, so the sums are the same to the bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn

from ..core.capture import gap_points, residual_streams
from ..core.model import DecoderStack, model_inputs
from ..core.offload import is_offloaded
from ..core.plan import Gap
from ..core.sequential import advance, capture, dense_sweep, view_stream
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
    points = gap_points(gaps)
    mlp_blocks = sorted({g.start - 1 for g in gaps if g.start > 0 and needs_mlp(stats[g.key])})
    if is_offloaded(model):
        batches = list(batches)
        return _accumulate_blockwise(model, stack, gaps, batches, stats, first_batch, points, mlp_blocks, progress)
    tokens = 0
    for index, batch in enumerate(batches, start=first_batch):
        ids, mask = model_inputs(model, batch)
        mlp: dict[int, torch.Tensor] = {}
        streams, first = residual_streams(model, stack, ids, mask, points, mlp_blocks, mlp)
        if not counted(batch):  # a padding batch: run (sharded blocks gather in lockstep), not counted
            continue
        where = f"calibration batch {index}"
        for point, stream in streams.items():
            check_finite(stream, mask, where, f"the residual stream entering block {point}", model)
        for block, out in mlp.items():
            check_finite(out, mask, where, f"the MLP output of block {block}", model)
        summed = counted_tokens(batch, mask)
        for gap in gaps:
            taps = GapTaps(streams[gap.start], streams[gap.stop], summed, first, mlp.get(gap.start - 1))
            for collector in stats[gap.key].values():
                collector.update(taps)
        tokens += int(summed.sum())
    return tokens


def _accumulate_blockwise(model, stack, gaps, batches, stats, first_batch, points, mlp_blocks, progress) -> int:
    """`accumulate` in one block-by-block pass: a gap's collectors are fed when the pass reaches its end, and
    the streams a later gap does not need are dropped."""
    held: dict[int, list[torch.Tensor]] = {}
    masks: list[torch.Tensor] = []
    sweep = dense_sweep(model, stack, batches, points, mlp_blocks, progress, "calibration statistics, block by block")
    for windows, point, streams, mlp in sweep:
        masks = windows.masks
        for b, stream in enumerate(streams):
            where = f"calibration batch {first_batch + b}"
            check_finite(stream, windows.masks[b], where, f"the residual stream entering block {point}", model)
        held[point] = streams
        for gap in (g for g in gaps if g.stop == point):
            for b, mask in enumerate(windows.masks):
                out = mlp[gap.start - 1][b] if gap.start - 1 in mlp else None
                if out is not None:
                    what = f"the MLP output of block {gap.start - 1}"
                    check_finite(out, mask, f"calibration batch {first_batch + b}", what, model)
                summed = counted_tokens(batches[b], mask)
                taps = GapTaps(held[gap.start][b], streams[b], summed, windows.first[b], out)
                for collector in stats[gap.key].values():
                    collector.update(taps)
        held = {p: s for p, s in held.items() if any(g.start == p and g.stop > point for g in gaps)}
    return sum(int(counted_tokens(batches[b], mask).sum()) for b, mask in enumerate(masks))


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
    if is_offloaded(pruned.model):
        return _students_blockwise(pruned, gap, list(batches), collectors, student_point, mlp_blocks)
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
            if not counted(batch):
                continue
            where = f"student statistics of view {view!r}, gap {gap.key}, batch {index}"
            check_finite(
                student[student_point], mask, where, f"the residual stream entering block {gap.stop}", pruned.model
            )
            summed = counted_tokens(batch, mask)
            taps = GapTaps(student[student_point], dense[gap.stop], summed, first, next(iter(mlp.values()), None))
            for collector in view_collectors.values():
                collector.update(taps)
            seconds[view] += time.perf_counter() - start
    return seconds


def _students_blockwise(pruned, gap, batches, collectors, student_point, mlp_blocks) -> dict[str, float]:
    """`accumulate_students` in one block-by-block pass: the dense stream and every view's advance together."""
    start = time.perf_counter()
    with pruned.use(DENSE):
        windows = capture(pruned.model, pruned.stack, batches)
    streams = [view_stream(pruned, DENSE, windows), *(view_stream(pruned, v, windows) for v in collectors)]
    stops = [gap.stop, *[student_point] * len(collectors)]
    taps, mlp = advance(
        streams,
        stops,
        windows,
        taps=[{s} for s in stops],
        mlp=[(), *(mlp_blocks[v] for v in collectors)],
        desc=f"student statistics for gap {gap.key}, block by block",
    )
    for b, mask in enumerate(windows.masks):
        for i, (view, view_collectors) in enumerate(collectors.items(), start=1):
            where = f"student statistics of view {view!r}, gap {gap.key}, batch {b}"
            student = taps[i][student_point][b]
            check_finite(student, mask, where, f"the residual stream entering block {gap.stop}", pruned.model)
            out = next(iter(mlp[i].values()))[b] if mlp[i] else None
            summed = counted_tokens(batches[b], mask)
            taps_b = GapTaps(student, taps[0][gap.stop][b], summed, windows.first[b], out)
            for collector in view_collectors.values():
                collector.update(taps_b)
    seconds = {view: s.seconds for view, s in zip(collectors, streams[1:])}
    return {DENSE: time.perf_counter() - start - sum(seconds.values()), **seconds}


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
