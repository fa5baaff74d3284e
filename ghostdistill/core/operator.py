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


class GhostOperator(nn.Module):
    """x ← x + x·M for ordinary tokens; x ← x + b for first-position tokens when `separate_first`.

    Parameters are stored in float32 (they come from a float64 solve) and cast to the activations'
    dtype when applied, so bf16/fp16 models run one matmul in their own dtype.
    """

    def __init__(
        self, hidden_size: int, *, separate_first: bool = False, fused: bool = False, affine: bool = False
    ) -> None:
        super().__init__()
        self.delta = nn.Parameter(torch.zeros(hidden_size, hidden_size))
        self.first_shift = nn.Parameter(torch.zeros(hidden_size))
        # Ordinary tokens get x + x·M + c when `affine` (the `bias` fit option); no parameter otherwise, so
        # existing checkpoints and the trainable set of non-affine operators are unchanged.
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if affine else None
        self.separate_first = separate_first
        # True when the exported model folds this map into existing weights (ReplaceMe, magnitude):
        # it then adds no parameters at inference.
        self.fused = fused

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
        y = x + x @ self.delta.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.separate_first and first_mask is not None:
            shifted = x + self.first_shift.to(x.dtype)
            y = torch.where(first_mask.unsqueeze(-1), shifted, y)
        return y

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.delta.shape[0]}, separate_first={self.separate_first}, fused={self.fused}, "
            f"affine={self.bias is not None}"
        )


def first_position_mask(position_ids: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    """Tokens at position 0 of their sequence, shaped like hidden[..., 0].

    With left padding, transformers' generate derives position ids from the attention mask, so the
    first real token is position 0 there too. Blocks called without position ids (older families) get
    the plain arange, which is right for unpadded, uncached inputs.
    """
    batch, seq = hidden.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
    return (position_ids == 0).expand(batch, seq)
