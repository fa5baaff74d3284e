"""ReplaceMe (Shopkhoev et al. 2025): a linear map T on the MLP output of the block before the gap.

With M the MLP output of the last block before the gap and Y = X_pre − M its residual input,
T = argmin ‖M T − (X_post − Y)‖² (float64 normal equations, `core.solver`). The map acts on the MLP output:
out·T = h·W_downᵀ·T, so `fold` writes it into that block's down projection, W_down ← Tᵀ·W_down, and the method
adds no parameters.

The fit assumes the MLP writes the residual stream itself (X_pre = Y + M). Where its output passes through a
norm first (Gemma 2 and 3: X_pre = Y + n(M), `post_feedforward_layernorm`), X_pre − M is not Y and the view's
n(M·T) renormalises what least squares fitted. The fold stays exact (the exported model computes the view), and
the view still beats no repair where measured (Gemma 3 270M without 4 blocks: 497.17 against the pruned model's
7251.04, docs/export.md; on tiny random Gemma 3 models it does not), so the method is not refused there
(docs/reliability.md, "What applies to which family").
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.model import MLP_OUT, last_linear, mlp_module
from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.solver import solve
from .interface import GapFit, GapTaps, Method, Solved, operator_of, register


class ReplaceMeStatistics:
    """ReplaceMe's normal equations, MᵀM and Mᵀ(X_post − Y), over the calibration tokens (module docstring)."""

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        self.mtm = torch.zeros(hidden_size, hidden_size, dtype=torch.float64, device=device)
        self.mtr = torch.zeros(hidden_size, hidden_size, dtype=torch.float64, device=device)
        self.tokens = 0

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        if taps.mlp_out is None:
            raise RuntimeError("ReplaceMe statistics need the MLP output of the block before the gap")
        keep = taps.mask.bool()
        m = taps.mlp_out[keep].to(torch.float64)
        y = taps.x_pre[keep].to(torch.float64) - m
        target = taps.x_post[keep].to(torch.float64) - y
        self.mtm += m.T @ m
        self.mtr += m.T @ target
        self.tokens += m.shape[0]

    def state_dict(self) -> dict:
        return {"mtm": self.mtm, "mtr": self.mtr, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.mtm, self.mtr, self.tokens = state["mtm"].double(), state["mtr"].double(), state["tokens"]


class ReplaceMe(Method):
    name = "replaceme"
    config = Solved  # solver, ridge, order
    folds = True
    needs_mlp = True
    statistics = ReplaceMeStatistics
    card = "ReplaceMe: a linear map on the MLP output of the block before each gap, folded into its down projection"

    def fit(self, cfg: Solved, gap: Gap, stats: ReplaceMeStatistics, hidden_size: int) -> GapFit:
        if gap.start == 0:
            raise ValueError(f"replaceme: gap {gap.key} starts at block 0, there is no MLP before it")
        what = f"{cfg.name} (replaceme) gap {gap.key}"
        t = solve(stats.mtm, stats.mtr, cfg.solver, cfg.ridge, tokens=stats.tokens, what=what)
        return GapFit(mlp_map=operator_of(t, fused=True))

    def identity(self, cfg: Solved, hidden_size: int) -> GapFit:
        return GapFit(mlp_map=GhostOperator(hidden_size, fused=True))

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        """`blocks`: the dense model's blocks (None where gone, or not being written now: export folds block by
        block); the block before the gap absorbs T."""
        if blocks[gap.start - 1] is None:
            return
        t = fit.mlp_map.delta.detach().double() + torch.eye(fit.mlp_map.delta.shape[0], dtype=torch.float64)
        fuse_mlp_map(blocks[gap.start - 1], t)


@torch.no_grad()
def fuse_mlp_map(block: nn.Module, t: torch.Tensor) -> None:
    """Make `block`'s MLP output h·W_downᵀ·T without an extra module."""
    fuse_output_map(last_linear(mlp_module(block), MLP_OUT), t)


def fuse_output_map(lin: nn.Linear, t: torch.Tensor) -> None:
    """`lin`'s output y ↦ y·T, written into it: W ← Tᵀ·W, b ← b·T (in float64)."""
    t = t.to(device=lin.weight.device, dtype=torch.float64)
    lin.weight.copy_((t.T @ lin.weight.to(torch.float64)).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.to(torch.float64) @ t).to(lin.bias.dtype))


register(ReplaceMe())
