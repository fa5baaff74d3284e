"""Folding the maps that need no extra module into existing weights (for export).

ReplaceMe's T acts on the MLP output of the block before the gap: out·T = h·W_downᵀ·T, so
W_down ← Tᵀ·W_down. Magnitude compensation scales the residual stream at the gap by s; in a pre-norm
model every later block sees its input through a scale-invariant norm, so the same function results
from dividing each later block's writes to the residual stream (attention output and MLP down
projections) by s, the final norm removing the overall factor.
"""

from __future__ import annotations

import torch
from torch import nn

from .calibration import mlp_module


def _last_linear(module: nn.Module, names: tuple[str, ...]) -> nn.Linear:
    for name in names:
        lin = getattr(module, name, None)
        if isinstance(lin, nn.Linear):
            return lin
    raise TypeError(f"{type(module).__name__} has none of {names}; cannot fold into it")


@torch.no_grad()
def fuse_mlp_map(block: nn.Module, t: torch.Tensor) -> None:
    """Make `block`'s MLP output h·W_downᵀ·T without an extra module."""
    down = _last_linear(mlp_module(block), ("down_proj", "c_proj", "fc2", "dense_4h_to_h"))
    t = t.to(torch.float64)
    down.weight.copy_((t.T @ down.weight.to(torch.float64)).to(down.weight.dtype))
    if down.bias is not None:
        down.bias.copy_((down.bias.to(torch.float64) @ t).to(down.bias.dtype))


@torch.no_grad()
def fold_residual_scale(blocks_after: list[nn.Module], s: float) -> None:
    """Divide every residual-stream write of the given blocks by s (see module docstring)."""
    for block in blocks_after:
        attn = getattr(block, "self_attn", None) or getattr(block, "attn", None)
        if attn is None:
            raise TypeError(f"{type(block).__name__} has no self_attn; cannot fold a residual scale")
        for lin in (_last_linear(attn, ("o_proj", "c_proj", "out_proj", "dense")),
                    _last_linear(mlp_module(block), ("down_proj", "c_proj", "fc2", "dense_4h_to_h"))):
            lin.weight.div_(s)
            if lin.bias is not None:
                lin.bias.div_(s)
