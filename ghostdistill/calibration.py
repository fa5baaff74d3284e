"""Streaming calibration: residual streams at the gap boundaries → per-gap float64 statistics.

Nothing but C×C accumulators is kept, so memory does not grow with the number of samples, and each
forward pass stops at the last block whose input we need.
"""

from __future__ import annotations

import time

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .model import DecoderStack
from .operator import first_position_mask
from .plan import Gap
from .statistics import GapTaps


if TYPE_CHECKING:
    from .pruning import PrunedModel


class _StopForward(Exception):
    """Raised from a hook once every requested residual stream has been captured."""


@torch.no_grad()
def residual_streams(
    model: nn.Module,
    stack: DecoderStack,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    points: Sequence[int],
    mlp_blocks: Sequence[int] = (),
    mlp_out: dict[int, torch.Tensor] | None = None,
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Residual stream entering block i for each i in `points` (i == number of blocks means the output
    of the last block, before the final norm) and the first-position mask; the MLP output of each block
    in `mlp_blocks` is put into `mlp_out`.

    Hooks on the blocks themselves rather than `output_hidden_states`, whose last entry is taken after
    the final norm, and so that the forward can stop early.
    """
    layers = stack.layers
    n = len(layers)
    wanted = sorted(set(points))
    if not wanted or wanted[0] < 0 or wanted[-1] > n:
        raise ValueError(f"residual stream points {list(points)} out of range 0..{n}")
    captured: dict[int, torch.Tensor] = {}
    mlp_out = {} if mlp_out is None else mlp_out
    positions: dict[str, torch.Tensor | None] = {}
    last = wanted[-1]
    handles = []

    def pre(i: int):
        def hook(module, args, kwargs):
            captured[i] = args[0] if args else kwargs["hidden_states"]
            positions.setdefault("ids", kwargs.get("position_ids"))
            if i == last:
                raise _StopForward
        return hook

    def post(module, args, kwargs, output):
        captured[n] = output[0] if isinstance(output, tuple) else output
        positions.setdefault("ids", kwargs.get("position_ids"))
        raise _StopForward

    def mlp_hook(i: int):
        def hook(module, args, output):
            mlp_out[i] = output[0] if isinstance(output, tuple) else output
        return hook

    try:
        for i in mlp_blocks:
            handles.append(mlp_module(layers[i]).register_forward_hook(mlp_hook(i)))
        for i in wanted:
            if i < n:
                handles.append(layers[i].register_forward_pre_hook(pre(i), with_kwargs=True))
            else:
                handles.append(layers[n - 1].register_forward_hook(post, with_kwargs=True))
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
    finally:
        for h in handles:
            h.remove()
    missing = set(wanted) - set(captured)
    if missing:
        raise RuntimeError(f"the forward pass never reached blocks {sorted(missing)}")
    first = first_position_mask(positions.get("ids"), captured[wanted[0]])
    return captured, first


def mlp_module(block: nn.Module) -> nn.Module:
    """The feed-forward sub-module of a block (its output is added to the residual stream)."""
    for name in ("mlp", "feed_forward", "ffn"):
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise TypeError(f"{type(block).__name__} has no `mlp` sub-module; ReplaceMe needs one to fuse into")


def gap_points(gaps: Sequence[Gap]) -> list[int]:
    return sorted({p for g in gaps for p in (g.start, g.stop)})


def _needs_mlp(collectors: dict[str, object]) -> bool:
    return any(getattr(c, "needs_mlp", False) for c in collectors.values())


@torch.no_grad()
def accumulate(
    model: nn.Module,
    stack: DecoderStack,
    gaps: Sequence[Gap],
    batches: Iterable[dict[str, torch.Tensor]],
    stats: dict[str, dict[str, object]],
) -> int:
    """Stream batches through the dense model and feed each gap's taps to its collectors.

    Every gap sees the dense model's own activations (the independent fit). Returns tokens seen.
    """
    points = gap_points(gaps)
    mlp_blocks = sorted({g.start - 1 for g in gaps if g.start > 0 and _needs_mlp(stats[g.key])})
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
    pruned: "PrunedModel",
    gap: Gap,
    batches: Iterable[dict[str, torch.Tensor]],
    collectors: dict[str, dict[str, object]],
) -> dict[str, float]:
    """Sequential fit: X_pre is what the pruned student (earlier gaps already repaired by a view) really
    feeds this gap; X_post is still the dense model's.

    `collectors` maps each view to the collectors it feeds. The dense forward is shared by every view:
    per batch one dense pass, then one pass per view, all stopping early. Returns the seconds spent in
    the dense passes (``"dense"``) and in each view's passes, so callers can report per-method costs.
    """
    from .pruning import DENSE

    kept = pruned.plan.kept
    student_point = kept.index(gap.stop) if gap.stop < pruned.plan.num_layers else len(kept)
    mlp_blocks = {
        view: [kept.index(gap.start - 1)] if gap.start > 0 and _needs_mlp(c) else [] for view, c in collectors.items()
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


def model_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    device = next(model.parameters()).device
    ids = batch["input_ids"].to(device)
    mask = batch.get("attention_mask")
    return ids, (torch.ones_like(ids) if mask is None else mask.to(device))
