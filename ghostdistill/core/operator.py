"""The boundary operator inserted at each gap: one C×C matmul on the residual stream.

Ordinary tokens get x ← x + x·M (that is x·W with W = I + M: writing it as a residual keeps the
identity exact in bf16 and makes zero-init the no-op for fine-tuning). First-position tokens carry
the "massive activations" that the removed blocks would have created; fitting W on them bends it for
every other token, so by default they get their own map, a mean shift x ← x + b, both in the fit and
here at inference.
"""

from __future__ import annotations

import torch
from torch import nn

# One definition for the in-memory views and the exported models: the modelling file exported folders carry.
from .modeling_ghostdistill import GapOperator, first_position_mask

__all__ = ["GhostOperator", "ReparametrisedOperator", "first_position_mask"]


class GhostOperator(GapOperator):
    """`GapOperator` (module docstring), its parameters stored in float32 (they come from a float64 solve) and
    cast to the activations' dtype when applied, so bf16/fp16 models run one matmul in their own dtype."""

    def __init__(
        self, hidden_size: int, *, separate_first: bool = False, fused: bool = False, affine: bool = False
    ) -> None:
        super().__init__(hidden_size, separate_first=separate_first)
        # Fused: export folds this map into existing weights (ReplaceMe, magnitude), adding no parameters at inference.
        self.fused = fused
        # Ordinary tokens get x + x·M + c when `affine` (the ghost `bias` fit option); no parameter
        # otherwise, so existing checkpoints and the trainable set of non-affine operators are unchanged.
        # The exported modelling file has no bias: `export` refuses affine operators.
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if affine else None

    def inference_parameters(self) -> int:
        if self.fused:
            return 0
        c = self.delta.shape[0]
        return c * c + (c if self.separate_first else 0) + (c if self.bias is not None else 0)

    @torch.no_grad()
    def load_solution(
        self, delta: torch.Tensor, first_shift: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> None:
        self.delta.copy_(delta.to(self.delta.dtype))
        if first_shift is not None:
            self.first_shift.copy_(first_shift.to(self.first_shift.dtype))
        if bias is not None:
            if self.bias is None:
                raise ValueError("this operator was built without a bias (affine=False); cannot load one")
            self.bias.copy_(bias.to(self.bias.dtype))

    def forward(self, x: torch.Tensor, first_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x, first_mask)
        if self.bias is None:
            return y
        shifted = y + self.bias.to(x.dtype)
        if self.separate_first and first_mask is not None:
            return torch.where(first_mask.unsqueeze(-1), y, shifted)  # first positions keep x + b
        return shifted

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.delta.shape[0]}, separate_first={self.separate_first}, fused={self.fused}, "
            f"affine={self.bias is not None}"
        )


class ReparametrisedOperator(GhostOperator):
    """A fine-tuned student's operator that stays within what its method folds: W = I + delta is computed
    from the fitted T = I + M₀ (`base` = M₀, a buffer) and a few trainable parameters, every token through W
    (no first shift, no bias). A subclass gives `change(T)` = W − T, zero when its parameters are at their
    start, so that `delta` = M₀ + (W − T) is M₀ to the bit there and the student starts from its closed form.
    Folded at export: no parameters at inference. (`methods.rotation.ScaledRotationOperator`,
    `methods.magnitude.ResidualScaleOperator`.)"""

    def __init__(self, fitted: GhostOperator) -> None:
        if fitted.separate_first or fitted.bias is not None:
            raise ValueError(
                f"{type(self).__name__} maps every token through W: the fitted operator must have no first "
                "shift and no bias"
            )
        # nn.Module's own init, not GapOperator's: `delta` is a property here, computed, not a parameter.
        nn.Module.__init__(self)
        self.separate_first, self.fused, self.bias = False, fitted.fused, None
        self.register_buffer("base", fitted.delta.detach().clone())
        # The overall scale e^s, 0 at the start; shape (1,), not 0-dim: FSDP2's fully_shard refuses scalar parameters.
        self.log_scale = nn.Parameter(torch.zeros(1, device=self.base.device))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Checkpoints written before log_scale had shape (1,) hold a 0-dim tensor: the same value.
        key = prefix + "log_scale"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def change(self, t: torch.Tensor) -> torch.Tensor:
        """W − T for the current parameters."""
        raise NotImplementedError

    @property
    def delta(self) -> torch.Tensor:
        t = self.base + torch.eye(self.base.shape[0], dtype=self.base.dtype, device=self.base.device)
        return self.base + self.change(t)

    def inference_parameters(self) -> int:
        return 0  # folded at export

    def extra_repr(self) -> str:
        return f"hidden_size={self.base.shape[0]}"
