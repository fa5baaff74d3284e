"""Capturing the residual stream at chosen block boundaries with hooks, stopping the forward early.

Hooks on the blocks themselves rather than `output_hidden_states`, whose last entry is taken after the
final norm, and so that the forward can stop after the last block needed (the 49k- or 128k-way logits
are never computed).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from .model import DecoderStack, mlp_module
from .operator import first_position_mask
from .plan import Gap
from .sharded import reshard_stopped


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
    in `mlp_blocks` is put into `mlp_out`."""
    layers = stack.layers
    n = len(layers)
    wanted = sorted(set(points))
    if not wanted or wanted[0] < 0 or wanted[-1] > n:
        raise ValueError(f"residual stream points {list(points)} out of range 0..{n}")
    captured: dict[int, torch.Tensor] = {}
    mlp_out = {} if mlp_out is None else mlp_out
    positions: dict[str, torch.Tensor | None] = {}
    handles = []

    def pre(i: int, module, args, kwargs):
        captured[i] = args[0] if args else kwargs["hidden_states"]
        positions.setdefault("ids", kwargs.get("position_ids"))
        if i == wanted[-1]:
            raise _StopForward

    def post(module, args, kwargs, output):
        captured[n] = output[0] if isinstance(output, tuple) else output
        positions.setdefault("ids", kwargs.get("position_ids"))
        raise _StopForward

    def mlp_hook(i: int, module, args, output):
        mlp_out[i] = output[0] if isinstance(output, tuple) else output

    try:
        for i in mlp_blocks:
            handles.append(mlp_module(layers[i]).register_forward_hook(partial(mlp_hook, i)))
        for i in wanted:
            if i < n:
                handles.append(layers[i].register_forward_pre_hook(partial(pre, i), with_kwargs=True))
            else:
                handles.append(layers[n - 1].register_forward_hook(post, with_kwargs=True))
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            # A sharded block (FSDP2) gathered its weights before the hook stopped its forward: free them.
            reshard_stopped(layers)
    finally:
        for h in handles:
            h.remove()
    missing = set(wanted) - set(captured)
    if missing:
        raise RuntimeError(f"the forward pass never reached blocks {sorted(missing)}")
    return captured, first_position_mask(positions.get("ids"), captured[wanted[0]])


def gap_points(gaps: Sequence[Gap]) -> list[int]:
    """The block boundaries a set of gaps needs: where each gap starts and where it ends."""
    return sorted({p for g in gaps for p in (g.start, g.stop)})
