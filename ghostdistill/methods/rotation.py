"""Rotation: one scaled orthogonal map W = c·Q per gap (weighted orthogonal Procrustes), on the residual stream.

Per gap, from ghost's statistics (`GhostStatistics`, weighting ``weighted``: w = 1/max(‖x_pre‖, ‖x_post‖)),
with A = Σ w² xᵀx and B = Σ w² xᵀ(y − x) (x = x_pre, y = x_post, row vectors), the cross moment is
M = Σ w² xᵀy = A + B. In float64:

- Q = argmin over orthogonal Q of Σ w² ‖x·c·Q − y‖² = argmax tr(Qᵀ M): with M = U S Vᵀ, Q = U Vᵀ;
- c = argmin over c of the same = tr(Qᵀ M) / tr(A) = Σ S / tr(A) (≥ 0).

The operator is a `GhostOperator` with delta c·Q − I (stored in float32, applied in the model's dtype).
Registered twice (the first-position option is a method name, not a `RecoveryConfig` key):

| method             | W fitted on            | first-position tokens at inference | export                     |
|--------------------|------------------------|------------------------------------|----------------------------|
| `rotation`         | other tokens, weighted | x + b, b = mean(X_post − X_pre)    | operator view (like ghost) |
| `rotation_through` | every token, weighted  | x·c·Q like every token             | folded: plain architecture |

`rotation_through` folds (SliceGPT's computational invariance of pre-norm RMSNorm models): the embedding
and the blocks before the gap are rotated by Q and the blocks after it write ÷ c (the blocks:
`fold_rotation` here; the embedding: `ghostdistill.export.fold`, whose docstring derives the fold), so the
exported model is the plain architecture with the surviving blocks and no operator module. Both read
`order` only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..core.operator import GhostOperator
from ..core.plan import Gap
from .ghost import GhostStatistics
from .interface import ORDER_KEYS, GapFit, NoFold, RecoveryConfig, register, residual_identity
from .magnitude import fold_residual_scale


def procrustes(xtx: torch.Tensor, xty: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(c, Q) minimising Σ w² ‖x·c·Q − y‖² over scalars c and orthogonal Q, from A = Σ w² xᵀx and
    M = Σ w² xᵀy (float64)."""
    xtx, xty = xtx.to(torch.float64), xty.to(torch.float64)
    u, s, vh = torch.linalg.svd(xty)
    q = u @ vh
    denom = float(torch.trace(xtx))
    if denom <= 0:
        raise ValueError("rotation fit: Σ w²‖x‖² is zero (no calibration tokens, or all of them zero)")
    return float(s.sum()) / denom, q


class _Rotation:
    keys = dict(ORDER_KEYS)
    through = False

    @property
    def all_parts(self) -> tuple[str, ...]:
        return ("weighted_rest", "weighted_first") if self.through else ("weighted_rest",)

    def parts(self, cfgs: Iterable[RecoveryConfig]) -> tuple[str, ...]:
        return self.all_parts

    def collector(
        self, hidden_size: int, device: torch.device | str, parts: Iterable[str] | None = None
    ) -> GhostStatistics:
        return GhostStatistics(hidden_size, device=device, groups=self.all_parts if parts is None else parts)

    def validate(self, cfg: RecoveryConfig) -> None:
        pass  # `order` is checked with every recovery entry (`validate_recovery`)

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        tokens = stats.counts.regular + (stats.counts.first if self.through else 0)
        if tokens == 0:
            raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
        xtx, xtd = stats.normal_equations("weighted", include_first=self.through)
        c, q = procrustes(xtx, xtx + xtd)
        eye = torch.eye(hidden_size, dtype=torch.float64, device=q.device)
        op = GhostOperator(hidden_size, separate_first=not self.through, fused=self.through)
        op.load_solution(c * q - eye, None if self.through else stats.first_shift())
        return GapFit(operator=op)


class Rotation(_Rotation, NoFold):
    name = "rotation"

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return GapFit(operator=GhostOperator(hidden_size, separate_first=True))


class RotationThrough(_Rotation):
    name = "rotation_through"
    through = True
    folds = True
    # The export writes the product of the gaps' rotations into the embedding too (`export.fold`).
    folds_embedding = True

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return residual_identity(cfg, hidden_size, fused=True)

    def fold(self, blocks: list[nn.Module | None], gap: Gap, fit: GapFit) -> None:
        """`blocks`: the dense model's blocks (None where gone): the surviving blocks before the gap are
        rotated by Q, those after it write ÷ c; the writer puts Q₁⋯Qₙ into the embedding. Called gap by gap
        in plan order (`export.fold` derives why that composes the gaps right)."""
        fold_rotation(blocks, gap, fit.operator)


# Decoder block classes the derivation above covers.
FOLDABLE_BLOCKS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_ATTN_IN, _MLP_IN = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# W is stored in float32: a fitted c·Q is orthogonal (after ÷ c) to about 1e-6.
ORTHOGONAL_TOL = 1e-4
# What refuses a block that is not one of those: a norm module name that sits inside a residual branch.
_POST_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_attention_norm", "post_mlp_norm")


def check_foldable(block: nn.Module) -> None:
    """Raise unless `block` has the pre-norm layout the rotation fold is exact for."""
    name = type(block).__name__
    if name in FOLDABLE_BLOCKS:
        return
    post = [n for n in _POST_NORMS if isinstance(getattr(block, n, None), nn.Module)]
    why = (
        f"it has norms inside the residual branch ({', '.join(post)}): a rotation of the residual stream "
        "does not commute with them"
        if post
        else "its block layout is not one the fold is derived for"
    )
    raise ValueError(
        f"cannot fold a rotation into {name}: {why}. The rotation fold is exact only for the pre-norm "
        f"RMSNorm blocks {', '.join(FOLDABLE_BLOCKS)}; export the `rotation` (operator) view instead"
    )


def scaled_rotation(operator: nn.Module) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(c, Q, T = c·Q) of a residual operator W = I + delta (float64), c = ‖W‖_F / √C."""
    delta = operator.delta.detach().to(torch.float64)
    t = delta + torch.eye(delta.shape[0], dtype=torch.float64, device=delta.device)
    c = float(t.norm()) / delta.shape[0] ** 0.5
    if not c > 0:
        raise ValueError("cannot fold a rotation whose scale is not positive")
    if getattr(operator, "separate_first", False) or getattr(operator, "bias", None) is not None:
        raise ValueError("only an operator mapping every token through W (no first shift, no bias) folds")
    q = t / c
    off = float((q.T @ q - torch.eye(q.shape[0], dtype=q.dtype, device=q.device)).abs().max())
    if off > ORTHOGONAL_TOL:
        raise ValueError(
            f"the operator is not a scaled rotation (max |QᵀQ − I| = {off:.2g} > {ORTHOGONAL_TOL:g}; fine-tuning "
            "moves W off c·Q): only a scaled rotation folds exactly"
        )
    return c, q, t


def _absorb_gain(norm: nn.Module, readers: list[nn.Linear]) -> None:
    gain = norm.weight.detach().to(torch.float64)
    for lin in readers:
        lin.weight.copy_((lin.weight.to(torch.float64) * gain).to(lin.weight.dtype))
    norm.weight.fill_(1.0)


def _read(lin: nn.Linear, q: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.to(torch.float64) @ q.to(lin.weight.device)).to(lin.weight.dtype))


def _write(lin: nn.Linear, t: torch.Tensor) -> None:
    t = t.to(lin.weight.device)
    lin.weight.copy_((t.T @ lin.weight.to(torch.float64)).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.to(torch.float64) @ t).to(lin.bias.dtype))


@torch.no_grad()
def rotate_blocks(blocks: list[nn.Module], q: torch.Tensor) -> None:
    """Transform each of `blocks` by the orthogonal Q (in place: the caller passes copies)."""
    for block in blocks:
        check_foldable(block)
        attn, mlp = block.self_attn, block.mlp
        readers = {
            block.input_layernorm: [getattr(attn, n) for n in _ATTN_IN],
            block.post_attention_layernorm: [getattr(mlp, n) for n in _MLP_IN],
        }
        for norm, lins in readers.items():
            _absorb_gain(norm, lins)
            for lin in lins:
                _read(lin, q)
        _write(attn.o_proj, q)
        _write(mlp.down_proj, q)


@torch.no_grad()
def fold_rotation(blocks: list[nn.Module | None], gap, operator: nn.Module) -> None:
    """One gap's T = c·Q into `blocks` (the dense model's blocks, None where gone; copies): the surviving
    blocks before the gap are rotated by Q, those after it write ÷ c (derived in `ghostdistill.export.fold`)."""
    c, q, _ = scaled_rotation(operator)
    before = [b for b in blocks[: gap.start] if b is not None]
    after = [b for b in blocks[gap.stop :] if b is not None]
    for block in before + after:
        check_foldable(block)
    if gap.start == 0:
        return  # nothing but the embedding before the gap: it takes all of c·Q (`fold_embedding`)
    rotate_blocks(before, q)
    fold_residual_scale(after, c)


register(Rotation())
register(RotationThrough())
