"""Operator anatomy: how much of a gap operator is antisymmetric, and its singular-value spectrum.

For W = I + M split M = S + K with S = (M + Mᵀ)/2 symmetric and K = (M − Mᵀ)/2 antisymmetric; the two
parts are orthogonal in the Frobenius inner product, so ‖M‖² = ‖S‖² + ‖K‖² and

    antisymmetric share of M = ‖K‖² / ‖M‖²,   of W = ‖K‖² / ‖W‖²   (W's antisymmetric part is K too).

S is the symmetric matrix nearest M (Frobenius), so the relative distance of M to the symmetric matrices
is ‖K‖ / ‖M‖ = √share; the best symmetric operator *for the fit's objective* is another matter, fitted
by the `ghost_symmetric` method and compared through alignment error and perplexity. A symmetric
construction (LinearPatch's H·diag(s)·Hᵀ, a scalar) has share 0 exactly; the Ghosted Layers claim is
that the least-squares optimum has a substantial share. The spectrum of M says how many directions the
repair really moves (effective rank exp(entropy of σ²/Σσ²)).
"""

from __future__ import annotations

import torch


def operator_anatomy(delta: torch.Tensor, top: int = 16) -> dict:
    """The anatomy of M = `delta` (W = I + M) in float64, singular values descending; `top` only bounds
    `top_singular_values`, the short list for tables."""
    if delta.ndim != 2 or delta.shape[0] != delta.shape[1]:
        raise ValueError(f"an operator is square; got shape {tuple(delta.shape)}")
    m = delta.detach().to(torch.float64).cpu()
    w = m + torch.eye(m.shape[0], dtype=torch.float64)
    anti = (m - m.T) / 2
    m2, w2, k2 = float((m * m).sum()), float((w * w).sum()), float((anti * anti).sum())
    sv = torch.linalg.svdvals(m)
    energy = sv.square()
    p = energy / energy.sum() if float(energy.sum()) > 0 else energy
    nz = p[p > 0]
    eff_rank = float(torch.exp(-(nz * nz.log()).sum())) if len(nz) else 0.0
    return {
        "antisym_share_M": k2 / m2 if m2 > 0 else 0.0,
        "antisym_share_W": k2 / w2,
        "norm_M": m2**0.5,
        "norm_W": w2**0.5,
        "distance_to_symmetric": (k2 / m2) ** 0.5 if m2 > 0 else 0.0,
        "spectral_norm_M": float(sv[0]) if len(sv) else 0.0,
        "effective_rank_M": eff_rank,
        "top_singular_values": [float(s) for s in sv[:top]],
        "singular_values": [float(s) for s in sv],
    }
