"""Alignment error on held-out tokens, per gap, method and token group, and the per-run analysis.

The closed form minimises ‖X_pre W − X_post‖² on the calibration tokens; this is the same quantity on
tokens it never saw, normalised by what doing nothing leaves:

    e = ‖X_pre W − X_post‖ / ‖X_post − X_pre‖        (e = 1: no better than the pruned model)

separately for first-position tokens (the massive activations, which `ghost` maps by x + b) and all
others. X_pre and X_post are the dense model's residual streams at the gap on held-out windows (the
evaluation windows, disjoint from calibration); with several gaps every gap is measured on the dense
model's X_pre, which is what a sequential fit's first gap sees and later gaps only approximately.

What each method puts at a gap is applied as it acts in its view: an operator on the residual stream
(ghost, ghost_symmetric, LinearPatch, and magnitude's scalar, which the view applies as x·sI), or, for
ReplaceMe, its map T on the MLP output u of the block before the gap: X_pre + u·T − u.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..core.capture import gap_points
from ..core.executor import executor_of, gap_pairs
from ..core.views import DENSE, PrunedModel
from .anatomy import operator_anatomy

GROUPS = ("other", "first")


@dataclass
class AlignmentErrors:
    """Float64 sums over tokens of one gap and view: Σ‖x̂ − x_post‖² (`err`), Σ‖x_post − x_pre‖² (`base`)
    and the token count, per group (`other`, `first`)."""

    err: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    base: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))

    @torch.no_grad()
    def update(
        self, x_hat: torch.Tensor, x_pre: torch.Tensor, x_post: torch.Tensor, mask: torch.Tensor, first: torch.Tensor
    ) -> None:
        keep = mask.bool()
        post = x_post[keep].to(torch.float64)
        err = (x_hat[keep].to(torch.float64) - post).square().sum(-1)
        base = (post - x_pre[keep].to(torch.float64)).square().sum(-1)
        is_first = first[keep]
        for group, rows in (("other", ~is_first), ("first", is_first)):
            self.err[group] += float(err[rows].sum())
            self.base[group] += float(base[rows].sum())
            self.tokens[group] += int(rows.sum())

    def ratio(self, group: str) -> float | None:
        """e for one group; None without tokens of that group."""
        if self.tokens[group] == 0 or self.base[group] == 0:
            return None
        return (self.err[group] / self.base[group]) ** 0.5

    def summary(self) -> dict:
        """`held_out_<group>`: e per group; `held_out_tokens`: the token counts."""
        return {**{f"held_out_{g}": self.ratio(g) for g in GROUPS}, "held_out_tokens": dict(self.tokens)}


def _repairs(pruned: PrunedModel, views: list[str], key: str) -> Iterator[tuple]:
    """(view, operator, MLP map) at gap `key` for each of `views` with either there (`dense` and `pruned` never)."""
    for view in views:
        if view not in pruned.operators:  # a method's view has both tables (`PrunedModel.add_method`)
            continue
        ops, mlps = pruned.operators[view], pruned.mlp_maps[view]  # nn.ModuleDicts: no `get`
        op, mlp_map = (ops[key] if key in ops else None), (mlps[key] if key in mlps else None)
        if op is not None or mlp_map is not None:
            yield view, op, mlp_map


@torch.no_grad()
def held_out_alignment(
    pruned: PrunedModel, views: list[str], batches: Iterable[dict[str, torch.Tensor]]
) -> dict[str, dict[str, AlignmentErrors]]:
    """{gap key: {view: AlignmentErrors}} over `batches`, one dense pass per batch that stops at the last
    gap's end. `pruned` is the identity (e = 1 by definition); views with nothing at a gap are left out."""
    gaps = pruned.plan.gaps
    model, stack = pruned.model, pruned.stack
    out = {g.key: {} for g in gaps}
    mlp_blocks = sorted(
        {g.start - 1 for g in gaps if g.start > 0 for _, _, m in _repairs(pruned, views, g.key) if m is not None}
    )
    with pruned.use(DENSE):
        reached = executor_of(model).dense_points(model, stack, batches, gap_points(gaps), mlp_blocks)
        for windows, k, before, after, mlp in gap_pairs(reached, [(g.start, g.stop) for g in gaps]):
            gap, start = gaps[k], gaps[k].start
            for b, (mask, first) in enumerate(zip(windows.masks, windows.first)):
                for view, op, mlp_map in _repairs(pruned, views, gap.key):
                    x_hat = before[b]
                    if mlp_map is not None:
                        u = mlp[start - 1][b]  # the MLP output of the block before the gap
                        x_hat = x_hat + mlp_map(u) - u
                    if op is not None:
                        x_hat = op(x_hat, first)
                    out[gap.key].setdefault(view, AlignmentErrors()).update(x_hat, before[b], after[b], mask, first)
    return out


def analyse(pruned: PrunedModel, views: list[str], batches: list[dict[str, torch.Tensor]]) -> dict:
    """Per gap and method: the anatomy of the residual-stream operator (where the method has one that is
    not a folded scalar or MLP map) and the held-out alignment errors; JSON-ready."""
    errors = held_out_alignment(pruned, views, batches)
    gaps = {gap.key: {} for gap in pruned.plan.gaps}
    for gap in pruned.plan.gaps:
        for view, op, _ in _repairs(pruned, views, gap.key):
            row = {"anatomy": "n/a: folded into existing weights (a scalar or a map on the MLP output)"}
            if op is not None and not op.fused:
                row["anatomy"] = operator_anatomy(op.delta)
            if view in errors[gap.key]:
                row.update(errors[gap.key][view].summary())
            gaps[gap.key][view] = row
    return {"held_out_windows": sum(int(b["input_ids"].shape[0]) for b in batches), "gaps": gaps}
