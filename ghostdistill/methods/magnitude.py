"""Magnitude compensation (Prune&Comp): one scalar per gap, s = mean‖X_post‖ / mean‖X_pre‖.

x ← s·x on the residual stream at the gap. In a pre-norm model every later block reads its input
through a scale-invariant norm, so the same function results from dividing each later block's writes
to the residual stream (attention output and MLP down projections) by s, the final norm removing the
overall factor (exact up to the norm's ε): `fold` does that, and the method adds no parameters. A block
whose branches end in a norm (Gemma 2 and 3: `post_attention_layernorm`, `post_feedforward_layernorm` normalise
the branch output before it is added) writes that norm's output, which dividing a linear before it would not
change: there the norm's gain is divided instead (γ ← γ/s, or for Gemma's x/rms(x)·(1 + γ), 1 + γ ← (1 + γ)/s).

A fine-tuned student trains the scale alone (`student_operator`: W = e^t·s·I, t trainable from 0), so it
still folds; `fold` refuses an operator that is not a multiple of the identity rather than drop the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.model import ATTN_OUT, MLP_OUT, last_linear, mlp_module
from ..core.operator import GhostOperator, ReparametrisedOperator
from ..core.plan import Gap
from .interface import GapFit, GapTaps, Method, Ordered, operator_of, register


class MagnitudeStatistics:
    """Mean token norms of X_pre and X_post: Prune&Comp's single magnitude-compensation scalar."""

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        self.norm_pre = torch.zeros((), dtype=torch.float64, device=device)
        self.norm_post = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = 0

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        keep = taps.mask.bool()
        self.norm_pre += taps.x_pre[keep].to(torch.float64).norm(dim=-1).sum()
        self.norm_post += taps.x_post[keep].to(torch.float64).norm(dim=-1).sum()
        self.tokens += int(keep.sum())

    def state_dict(self) -> dict:
        return {"norm_pre": self.norm_pre, "norm_post": self.norm_post, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.norm_pre, self.norm_post = state["norm_pre"].double(), state["norm_post"].double()
        self.tokens = state["tokens"]


class Magnitude(Method):
    name = "magnitude"
    folds = True
    statistics = MagnitudeStatistics
    card = "magnitude compensation: one scale per gap, folded into the output projections of the later blocks"

    def fit(self, cfg: Ordered, gap: Gap, stats: MagnitudeStatistics, hidden_size: int) -> GapFit:
        s = stats.norm_post / stats.norm_pre.clamp_min(1e-12)
        eye = torch.eye(hidden_size, dtype=torch.float64, device=s.device)
        return GapFit(operator=operator_of(s * eye, fused=True))

    def identity(self, cfg: Ordered, hidden_size: int) -> GapFit:
        return GapFit(operator=GhostOperator(hidden_size, fused=True))

    def student_operator(self, operator: GhostOperator) -> ResidualScaleOperator:
        """What a student trains in place of the fitted s·I: the scale (module docstring)."""
        return ResidualScaleOperator(operator)

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        """`blocks`: the dense model's blocks (None where a block is gone); every surviving block after
        the gap gets its writes / s.

        With several gaps the scales compound, which is what dividing block by block gives."""
        delta = fit.operator.delta.detach().to(torch.float64)
        s = float(delta[0, 0]) + 1.0
        eye = torch.eye(delta.shape[0], dtype=torch.float64, device=delta.device)
        off = float((delta + eye - s * eye).abs().max())
        if off > SCALE_TOL * max(1.0, abs(s)):
            raise ValueError(
                f"gap {gap.key}: the magnitude operator is not a multiple of the identity (max |W − s·I| = "
                f"{off:.2g}); only a scale folds: train it as `magnitude`'s students do (`student_operator`)"
            )
        fold_residual_scale([b for b in blocks[gap.stop :] if b is not None], s)


# W = s·I is stored in float32: its off-scale entries are exact zeros, its diagonal equal to the bit.
SCALE_TOL = 1e-6


class ResidualScaleOperator(ReparametrisedOperator):
    """W = e^t·(I + M₀) with M₀ = (s − 1)·I the fitted scale's delta and t trainable (`log_scale`, 0 at the
    start, where `delta` is M₀ to the bit)."""

    def change(self, t: torch.Tensor) -> torch.Tensor:
        return (self.log_scale.exp() - 1) * t


# The norms that end a block's two branches where a branch ends in a norm (Gemma 2, Gemma 3).
BRANCH_END_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


@torch.no_grad()
def gain_offset(norm: nn.Module) -> float:
    """1.0 for a norm computing x/rms(x)·(1 + γ) (Gemma's), 0.0 for x/rms(x)·γ: its output with γ = 0 says."""
    weight = norm.weight
    saved = weight.detach().clone()
    weight.zero_()
    try:
        out = norm(torch.ones(1, weight.shape[0], dtype=weight.dtype, device=weight.device))
    finally:
        weight.copy_(saved)
    return 1.0 if float(out.abs().max()) > 0.5 else 0.0


@torch.no_grad()
def fold_residual_scale(blocks_after: list[nn.Module], s: float) -> None:
    """Divide every residual-stream write of the given blocks by s (see module docstring)."""
    for block in blocks_after:
        if isinstance(getattr(block, BRANCH_END_NORMS[1], None), nn.Module):
            for norm in (getattr(block, name) for name in BRANCH_END_NORMS):
                offset = gain_offset(norm)
                norm.weight.copy_(((norm.weight.double() + offset) / s - offset).to(norm.weight.dtype))
            continue
        attn = getattr(block, "self_attn", None) or getattr(block, "attn", None)
        if attn is None:
            raise TypeError(f"{type(block).__name__} has no self_attn; cannot fold a residual scale")
        for lin in (last_linear(attn, ATTN_OUT), last_linear(mlp_module(block), MLP_OUT)):
            lin.weight.div_(s)
            if lin.bias is not None:
                lin.bias.div_(s)


register(Magnitude())
