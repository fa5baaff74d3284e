"""Streaming calibration: residual streams at the gap boundaries → per-gap float64 statistics.

Nothing but C×C accumulators is kept, so memory does not grow with the number of samples, and each
forward pass stops at the last block whose input we need.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .model import DecoderStack
from .operator import first_position_mask
from .plan import Gap


class _StopForward(Exception):
    """Raised from a hook once every requested residual stream has been captured."""


@torch.no_grad()
def residual_streams(
    model: nn.Module,
    stack: DecoderStack,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    points: Sequence[int],
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Residual stream entering block i for each i in `points` (i == number of blocks means the output
    of the last block, before the final norm), plus the first-position mask.

    Hooks on the blocks themselves rather than `output_hidden_states`, whose last entry is taken after
    the final norm, and so that the forward can stop early.
    """
    layers = stack.layers
    n = len(layers)
    wanted = sorted(set(points))
    if not wanted or wanted[0] < 0 or wanted[-1] > n:
        raise ValueError(f"residual stream points {list(points)} out of range 0..{n}")
    captured: dict[int, torch.Tensor] = {}
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

    try:
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


@dataclass
class TokenCounts:
    regular: int = 0
    first: int = 0
    massive_first: int = 0
    massive_other: int = 0


class GapStatistics:
    """Float64 accumulators for one gap, split by token group so every fit variant comes from one pass.

    `plain_*` are unweighted, `weighted_*` weigh each token's residual by 1/max(‖x_pre‖, ‖x_post‖);
    `rest` excludes first-position tokens, `first` holds only them.
    """

    GROUPS = ("plain_rest", "plain_first", "weighted_rest", "weighted_first")
    # A token whose x_post norm exceeds this multiple of the median is counted as a massive activation
    # (reported only: it tells the user whether sinks other than the first token exist).
    MASSIVE_RATIO = 20.0

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        c = hidden_size
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.xtx = {g: z(c, c) for g in self.GROUPS}
        self.xtd = {g: z(c, c) for g in self.GROUPS}
        self.first_delta_sum = z(c)
        self.counts = TokenCounts()

    @torch.no_grad()
    def update(self, x_pre: torch.Tensor, x_post: torch.Tensor, token_mask: torch.Tensor, first: torch.Tensor) -> None:
        keep = token_mask.bool()
        x = x_pre[keep].to(torch.float64)
        d = x_post[keep].to(torch.float64) - x
        is_first = first[keep]
        post_norm = (x + d).norm(dim=-1)
        weight = 1.0 / torch.maximum(x.norm(dim=-1), post_norm).clamp_min(1e-12)
        for group, rows in (("rest", ~is_first), ("first", is_first)):
            if not rows.any():
                continue
            xs, ds, ws = x[rows], d[rows], weight[rows].unsqueeze(1)
            self.xtx[f"plain_{group}"] += xs.T @ xs
            self.xtd[f"plain_{group}"] += xs.T @ ds
            xw, dw = xs * ws, ds * ws
            self.xtx[f"weighted_{group}"] += xw.T @ xw
            self.xtd[f"weighted_{group}"] += xw.T @ dw
        self.first_delta_sum += d[is_first].sum(0)
        massive = post_norm > self.MASSIVE_RATIO * post_norm.median()
        self.counts.regular += int((~is_first).sum())
        self.counts.first += int(is_first.sum())
        self.counts.massive_first += int((massive & is_first).sum())
        self.counts.massive_other += int((massive & ~is_first).sum())

    def normal_equations(self, weighted: bool, include_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "weighted" if weighted else "plain"
        xtx, xtd = self.xtx[f"{kind}_rest"].clone(), self.xtd[f"{kind}_rest"].clone()
        if include_first:
            xtx += self.xtx[f"{kind}_first"]
            xtd += self.xtd[f"{kind}_first"]
        return xtx, xtd

    def first_shift(self) -> torch.Tensor:
        return self.first_delta_sum / max(self.counts.first, 1)

    def state_dict(self) -> dict:
        return {
            "xtx": self.xtx,
            "xtd": self.xtd,
            "first_delta_sum": self.first_delta_sum,
            "counts": vars(self.counts).copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.xtx = {k: v.to(torch.float64) for k, v in state["xtx"].items()}
        self.xtd = {k: v.to(torch.float64) for k, v in state["xtd"].items()}
        self.first_delta_sum = state["first_delta_sum"].to(torch.float64)
        self.counts = TokenCounts(**state["counts"])


def gap_points(gaps: Sequence[Gap]) -> list[int]:
    return sorted({p for g in gaps for p in (g.start, g.stop)})


@torch.no_grad()
def accumulate(
    model: nn.Module,
    stack: DecoderStack,
    gaps: Sequence[Gap],
    batches: Iterable[dict[str, torch.Tensor]],
    stats: dict[str, GapStatistics],
) -> int:
    """Stream batches through the dense model and add each gap's (X_pre, X_post) to its statistics.

    Every gap is fitted on the dense model's own activations (independent fit). Returns tokens seen.
    """
    points = gap_points(gaps)
    tokens = 0
    for batch in batches:
        device = next(model.parameters()).device
        ids = batch["input_ids"].to(device)
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask.to(device)
        streams, first = residual_streams(model, stack, ids, mask, points)
        for gap in gaps:
            stats[gap.key].update(streams[gap.start], streams[gap.stop], mask, first)
        tokens += int(mask.sum())
    return tokens
