"""Rotation: one scaled orthogonal map W = c·Q per gap (weighted orthogonal Procrustes), on the residual stream.

Per gap, from ghost's statistics (`GhostStatistics`, weighting ``weighted``: w = 1/max(‖x_pre‖, ‖x_post‖)),
with A = Σ w² xᵀx and B = Σ w² xᵀ(y − x) (x = x_pre, y = x_post, row vectors), the cross moment is
M = Σ w² xᵀy = A + B. In float64:

- Q = argmin over orthogonal Q of Σ w² ‖x·c·Q − y‖² = argmax tr(Qᵀ M): with M = U S Vᵀ, Q = U Vᵀ;
- c = argmin over c of the same = tr(Qᵀ M) / tr(A) = Σ S / tr(A) (≥ 0).

`rotation_anchored` constrains Q to fix one unit direction u (row vector): u·Q = u. The first position
carries a massive activation along an almost fixed direction (SmolLM2-135M: norm ≈ 23,000 against ≈ 140,
written by an early block); the blocks after the gap read it through RMSNorm, which is blind to its scale
(c) but not to a turn, and the free Procrustes Q turns a few percent of it into other channels: thousands
of units. With B an orthonormal basis of u's complement (C × (C−1), the last C − 1 columns of the complete
QR of uᵀ), every orthogonal Q with u·Q = u is Q = uᵀu + B·R·Bᵀ with R orthogonal ((C−1) × (C−1)), and
tr(Qᵀ M) = u·M·uᵀ + tr(Rᵀ·BᵀMB): R = U' V'ᵀ from BᵀMB = U' S' V'ᵀ, c = tr(Qᵀ M) / tr(A) (refused unless
> 0). u is the first-position tokens' Σ w² x (x = x_pre), normalised: with w ≈ 1/‖x‖ there, the mean of
their directions. On SmolLM2-135M (C4 32 × 512) it is within 1e-5 in cosine of the top eigenvector of their
Σ w² xᵀx, and scored the same or better (WikiText-2 perplexity 70.49 / 70.49 at blocks 12–18, 230.98 /
231.32 at 9–19, 186.98 / 187.44 at 8–18; docs/export.md), with no sign to choose and no eigensolve.

The operator is a `GhostOperator` with delta c·Q − I (stored in float32, applied in the model's dtype).
Registered three times (the first-position option is a method name, not a `RecoveryConfig` key):

| method              | W fitted on            | first-position tokens at inference | export                     |
|---------------------|------------------------|------------------------------------|----------------------------|
| `rotation`          | other tokens, weighted | x + b, b = mean(X_post − X_pre)    | operator view (like ghost) |
| `rotation_through`  | every token, weighted  | x·c·Q like every token             | folded: plain architecture |
| `rotation_anchored` | every token, weighted; u·Q = u | x·c·Q like every token     | folded: plain architecture |

Their fine-tuned students (`train: [operators, ...]`) train within the scaled rotations, so they still fold:
`student_operator` turns the fitted c₀·Q₀ into W = e^s·c₀·Q₀·exp(A) with s (a scalar) and A trainable, both
zero at the start (the closed form exactly). A = G − Gᵀ for `rotation_through` (any rotation); for
`rotation_anchored` A = P(G − Gᵀ)P with P = I − uᵀu, so u·A = 0, u·exp(A) = u and u·Q = u stays true. The
exponential of a skew matrix is orthogonal, and W's off-orthogonality stays at float rounding
(`ScaledRotationOperator`). A freely trained W = I + M would not fold (`scaled_rotation` refuses it).

`rotation_through` and `rotation_anchored` fold (SliceGPT's computational invariance of pre-norm RMSNorm models):
the embedding and the blocks before the gap are rotated by Q and the blocks after it write ÷ c (the blocks:
`fold_rotation` here; the embedding: `ghostdistill.export.fold`, whose docstring derives the fold), so the exported
model is the plain architecture with the surviving blocks and no operator module. All three read `order` only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from ..core.operator import GhostOperator, ReparametrisedOperator
from ..core.plan import Gap
from ..core.sharded import plain_class
from .family import FamilyFacts
from .ghost import GhostCollectorMixin, GhostStatistics
from .interface import GapFit, Ordered, register
from .magnitude import fold_residual_scale
from .replaceme import fuse_output_map


def procrustes(xtx: torch.Tensor, xty: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(c, Q) minimising Σ w² ‖x·c·Q − y‖² over scalars c and orthogonal Q, from A = Σ w² xᵀx and
    M = Σ w² xᵀy (float64)."""
    xtx, xty = xtx.to(torch.float64), xty.to(torch.float64)
    u, s, vh = torch.linalg.svd(xty)
    return float(s.sum()) / _scale_denominator(xtx), u @ vh


def _scale_denominator(xtx: torch.Tensor) -> float:
    """tr(A) = Σ w²‖x‖², the denominator of the best scale c = tr(Qᵀ M) / tr(A)."""
    denom = float(torch.trace(xtx))
    if denom <= 0:
        raise ValueError("rotation fit: Σ w²‖x‖² is zero (no calibration tokens, or all of them zero)")
    return denom


def anchored_procrustes(xtx: torch.Tensor, xty: torch.Tensor, u: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(c, Q) minimising Σ w² ‖x·c·Q − y‖² over scalars c and orthogonal Q with u·Q = u, from A = Σ w² xᵀx,
    M = Σ w² xᵀy and the direction u (normalised here); float64. Derived in the module docstring."""
    xtx, xty, u = xtx.to(torch.float64), xty.to(torch.float64), u.to(torch.float64)
    norm = float(u.norm())
    if not norm > 0:
        raise ValueError(f"anchored rotation fit: the fixed direction u has norm {norm}; it must be a nonzero vector")
    u = u / norm
    # The complete QR of uᵀ: its first column is ±u, the others an orthonormal basis B of u's complement.
    basis, _ = torch.linalg.qr(u[:, None], mode="complete")
    b = basis[:, 1:]
    left, _, right = torch.linalg.svd(b.T @ xty @ b)
    q = torch.outer(u, u) + b @ (left @ right) @ b.T
    c = float(torch.trace(q.T @ xty)) / _scale_denominator(xtx)
    if not c > 0:
        raise ValueError(
            f"anchored rotation fit: the best scale c = {c:.3g} is not positive (x_post points against x_pre "
            "along u); only c > 0 folds: use `rotation_through` or `ghost` for this gap"
        )
    return c, q


def first_direction(stats: GhostStatistics) -> torch.Tensor:
    """u: the first-position tokens' Σ w² x (weighting ``weighted``, x = x_pre), normalised."""
    if stats.counts.first == 0:
        raise ValueError("anchored rotation fit: no first-position tokens in the calibration statistics; u needs some")
    stats.group_keys("weighted", include_first=True)  # names the groups it holds when `weighted_first` is not one
    mean = stats.xsum["weighted_first"].to(torch.float64)
    norm = float(mean.norm())
    if not norm > 0:
        raise ValueError(
            f"anchored rotation fit: the first positions' mean Σ w² x has norm {norm}; u needs a direction"
        )
    return mean / norm


class Rotation(GhostCollectorMixin):
    name = "rotation"
    card = "rotation: W = c·Q at each gap (weighted Procrustes), first-position tokens shifted apart"
    through = False  # `rotation_through`: every token through W

    @property
    def all_groups(self) -> tuple[str, ...]:
        return ("weighted_rest", "weighted_first") if self.through else ("weighted_rest",)

    def groups(self, cfgs: Iterable[Ordered]) -> tuple[str, ...]:
        return self.all_groups

    def fit(self, cfg: Ordered, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        tokens = stats.counts.regular + (stats.counts.first if self.through else 0)
        if tokens == 0:
            raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
        xtx, xtd = stats.normal_equations("weighted", include_first=self.through)
        try:
            # (c, Q) from A = Σ w² xᵀx and M = Σ w² xᵀy: the free Procrustes, or fixing the anchor u (u·Q = u).
            anchor = self.anchor(stats)
            c, q = procrustes(xtx, xtx + xtd) if anchor is None else anchored_procrustes(xtx, xtx + xtd, anchor)
        except ValueError as err:
            raise ValueError(f"gap {gap.key}: {err}") from None
        eye = torch.eye(hidden_size, dtype=torch.float64, device=q.device)
        op = self.identity(cfg, hidden_size).operator
        op.load_solution(c * q - eye, None if self.through else stats.first_shift())
        if anchor is not None:
            # What a student keeps fixed when it trains this rotation (`student_operator`); not saved: a
            # resumed run solves the operators again from the statistics.
            op.register_buffer("anchor", anchor.to(torch.float32), persistent=False)
        return GapFit(operator=op)

    def identity(self, cfg: Ordered, hidden_size: int) -> GapFit:
        return GapFit(operator=GhostOperator(hidden_size, separate_first=not self.through, fused=self.through))

    def anchor(self, stats: GhostStatistics) -> torch.Tensor | None:
        """The direction the fitted Q fixes (u·Q = u), or None."""
        return None


class RotationThrough(Rotation):
    name = "rotation_through"
    through = True
    folds = True
    folds_embedding = True  # the export writes the product of the gaps' rotations into the embedding (`export.fold`)
    card = "rotation_through: W = c·Q at each gap (weighted Procrustes) for every token, folded into the weights"

    def student_operator(self, operator: GhostOperator) -> ScaledRotationOperator:
        """What a student trains in place of the fitted operator: the scaled rotations around it (module
        docstring), so that the fine-tuned view still folds."""
        return ScaledRotationOperator(operator)

    def supports(self, cfg: Ordered, family: FamilyFacts) -> str | None:
        """Refused where the fold is not exact: folding is this method's point (`rotation` is its operator view)."""
        why = fold_refusal(family.block)
        return None if why is None else f"its fold into the stock weights is not exact for {family.block_class}: {why}"

    def fold(self, blocks: list[nn.Module | None], gap: Gap, fit: GapFit) -> None:
        """`fold_rotation`; the writer puts Q₁⋯Qₙ into the embedding. Called gap by gap in plan order
        (`export.fold` derives why that composes the gaps right)."""
        fold_rotation(blocks, gap, fit.operator)


ANCHOR_SHARE = 0.5  # the share of first-position tokens counted massive (`TokenCounts.massive_first`) it needs


class RotationAnchored(RotationThrough):
    """`rotation_through` with Q fixing the first position's massive direction u (module docstring). Where the first
    position carries no massive activation (issue 39: another family, 17.6× the pruned model's perplexity), the
    gap is fitted as `rotation_through` and its note says so (log, results.json, results.md)."""

    name = "rotation_anchored"
    card = "rotation_anchored: W = c·Q at each gap, Q fixing the first position's massive direction, folded"

    def anchor(self, stats: GhostStatistics) -> torch.Tensor:
        return first_direction(stats)

    def fit(self, cfg: Ordered, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        counts = stats.counts
        if counts.first > 0 and counts.massive_first >= ANCHOR_SHARE * counts.first:
            return super().fit(cfg, gap, stats, hidden_size)
        return replace(
            RotationThrough.fit(_THROUGH, cfg, gap, stats, hidden_size),
            note=f"the first position carries no massive activation ({counts.massive_first} of {counts.first} "
            f"first-position tokens above {GhostStatistics.MASSIVE_RATIO:g}× the median norm after the gap), so "
            "rotation_anchored has no direction to anchor: fitted as rotation_through (no fixed direction)",
        )


class ScaledRotationOperator(ReparametrisedOperator):
    """W = e^s·T·exp(A) on every token, T = I + M₀ = c₀·Q₀ the fitted scaled rotation, s and the generator G
    trainable (A from G, fixing `anchor` u where the fit has one: module docstring). At the start (s = 0, G = 0:
    exp(0) = I exactly) `delta` is M₀ to the bit (`ReparametrisedOperator`). Applied like any operator:
    x ← x + x·delta, one C × C matrix exponential per forward."""

    def __init__(self, fitted: GhostOperator) -> None:
        super().__init__(fitted)
        anchor = getattr(fitted, "anchor", None)
        self.register_buffer("anchor", None if anchor is None else anchor.to(torch.float32) / anchor.norm())
        self.generator = nn.Parameter(torch.zeros_like(self.base))

    def change(self, t: torch.Tensor) -> torch.Tensor:
        a = self.generator - self.generator.T
        if self.anchor is not None:
            # P·A·P with P = I − uᵀu, without forming P: A − uᵀ(u·A) − (A·uᵀ)u + uᵀ(u·A·uᵀ)u.
            u = self.anchor
            ua, au = u @ a, a @ u
            a = a - torch.outer(u, ua) - torch.outer(au, u) + (ua @ u) * torch.outer(u, u)
        return self.log_scale.exp() * (t @ torch.linalg.matrix_exp(a)) - t

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, anchored={self.anchor is not None}"


# Decoder block classes the derivation above covers.
FOLDABLE_BLOCKS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
_ATTN_IN, _MLP_IN = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# W is stored in float32: a fitted c·Q is orthogonal (after ÷ c) to about 1e-6.
ORTHOGONAL_TOL = 1e-4
# What refuses a block that is not one of those: a norm module name that sits inside a residual branch.
_POST_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_attention_norm", "post_mlp_norm")


def fold_refusal(block: nn.Module) -> str | None:
    """Why the rotation fold is not exact for `block`'s layout, or None: a pre-norm layout it is derived for."""
    if plain_class(block).__name__ in FOLDABLE_BLOCKS:
        return None
    if post := [n for n in _POST_NORMS if isinstance(getattr(block, n, None), nn.Module)]:
        return (
            f"it has norms inside the residual branch ({', '.join(post)}): a rotation of the residual stream "
            "does not commute with them"
        )
    return "its block layout is not one the fold is derived for"


def check_foldable(block: nn.Module) -> None:
    """Raise unless `block` has the pre-norm layout the rotation fold is exact for."""
    why = fold_refusal(block)
    if why is not None:
        raise ValueError(
            f"cannot fold a rotation into {plain_class(block).__name__}: {why}. The rotation fold is exact only for "
            f"the pre-norm RMSNorm blocks {', '.join(FOLDABLE_BLOCKS)}; export the `rotation` (operator) view instead"
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


@torch.no_grad()
def rotate_blocks(blocks: list[nn.Module], q: torch.Tensor) -> None:
    """Transform each of `blocks` by the orthogonal Q (in place: the caller passes checked copies)."""
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        readers = {
            block.input_layernorm: [getattr(attn, n) for n in _ATTN_IN],
            block.post_attention_layernorm: [getattr(mlp, n) for n in _MLP_IN],
        }
        for norm, lins in readers.items():
            gain = norm.weight.detach().to(torch.float64)
            for lin in lins:  # γ into the linears that read the norm (γ ← 1), then W' = W·Q
                lin.weight.copy_((lin.weight.to(torch.float64) * gain).to(lin.weight.dtype))
                lin.weight.copy_((lin.weight.to(torch.float64) @ q.to(lin.weight.device)).to(lin.weight.dtype))
            norm.weight.fill_(1.0)
        fuse_output_map(attn.o_proj, q)
        fuse_output_map(mlp.down_proj, q)


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
        return  # nothing but the embedding before the gap: it takes all of c·Q (`export.fold`)
    rotate_blocks(before, q)
    fold_residual_scale(after, c)


_THROUGH = RotationThrough()
register(Rotation())
register(_THROUGH)
register(RotationAnchored())
