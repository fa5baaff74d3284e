"""Closed-form least squares from accumulated statistics, in float64.

We never hold the calibration activations, only A = XᵀX and B = XᵀD (D = X_post − X_pre), so both
solvers work on the normal equations: min_M ||X M − D||² ⇔ A M = B.

`solve_symmetric` is the same problem with M constrained to be symmetric (W = I + M symmetric, the
family LinearPatch's H·diag(s)·Hᵀ lives in). Setting the gradient of ||X M − D||² + ε||M||² to zero
within symmetric matrices gives the Lyapunov equation (A + εI) M + M (A + εI) = B + Bᵀ; in the
eigenbasis A + εI = Q diag(λ) Qᵀ it decouples: (QᵀMQ)_ij = (Qᵀ(B + Bᵀ)Q)_ij / (λ_i + λ_j).

With n tokens and hidden size C, rank(A) ≤ min(n, C): fewer tokens than channels leave A singular and the
problem under-determined (any M + N with XN = 0 fits as well). `solve`, told n, then returns the
minimum-norm solution A⁺B (the limit of the ridge solution as ε → 0, and the one that changes the residual
stream least off the calibration data) and warns with the token count that would make A full rank.
Everything is float64 whatever the model's dtype: half precision has no stable linalg and XᵀX of
activations of norm ~100 overflows float16 at once.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

SolverName = Literal["ridge", "lstsq"]


def solve_ridge(xtx: torch.Tensor, xtd: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """M = (A + εI)⁻¹ B with ε = ridge · tr(A)/C.

    ε scales with the mean eigenvalue of A, so one `ridge` value means the same thing for a model
    whose residual stream has norm 1 or 1000, and for 10 or 10⁶ calibration tokens.
    """
    eps = _check(xtx, xtd, ridge)
    eye = torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)
    a = xtx + max(float(eps), torch.finfo(xtx.dtype).tiny) * eye
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(xtd, chol)
    # Rounding can leave A + εI indefinite when ε is tiny; fall back to the symmetric solver.
    return torch.linalg.solve(a, xtd)


def solve_lstsq(xtx: torch.Tensor, xtd: torch.Tensor) -> torch.Tensor:
    """Minimum-norm least-squares solution: M = A⁺ B via the eigendecomposition of A = XᵀX.

    Since range(B) ⊆ range(Xᵀ) = range(A), A⁺B is exactly the minimum-norm minimiser of ||XM − D||;
    eigenvalues below C·ε·λ_max are treated as zero (ε the machine epsilon, as numpy does).
    """
    _check(xtx, xtd)
    evals, evecs = torch.linalg.eigh(xtx)
    cutoff = xtx.shape[0] * torch.finfo(xtx.dtype).eps * evals.abs().max()
    inv = torch.where(evals > cutoff, 1.0 / evals, torch.zeros_like(evals))
    return evecs @ (inv.unsqueeze(1) * (evecs.T @ xtd))


def solve_symmetric(xtx: torch.Tensor, xtd: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """The best symmetric M: argmin ||X M − D||² + ε||M||² over M = Mᵀ, ε = ridge · tr(A)/C.

    With ridge 0 and a singular A, pairs of null directions (λ_i + λ_j = 0) get 0: the minimum-norm
    symmetric solution.
    """
    eps = _check(xtx, xtd, ridge)
    evals, q = torch.linalg.eigh(xtx)
    evals = evals.clamp_min(0) + eps
    rhs = q.T @ (xtd + xtd.T) @ q
    denom = evals.unsqueeze(0) + evals.unsqueeze(1)
    cutoff = xtx.shape[0] * torch.finfo(xtx.dtype).eps * float(denom.max())
    tilde = torch.where(denom > cutoff, rhs / denom.clamp_min(cutoff), torch.zeros_like(rhs))
    m = q @ tilde @ q.T
    return (m + m.T) / 2  # exact symmetry, not up to rounding


class RankDeficientWarning(UserWarning):
    """Fewer calibration tokens than the hidden size: the fit fell back to the minimum-norm solution."""


def solve(
    xtx: torch.Tensor,
    xtd: torch.Tensor,
    solver: SolverName = "ridge",
    ridge: float = 1e-4,
    *,
    tokens: int | None = None,
    what: str = "fit",
) -> torch.Tensor:
    """M with A M = B by `solver`; with `tokens` (the n behind A) < C, the minimum-norm solution and a
    `RankDeficientWarning` naming `what`, n, C and how many tokens would be enough."""
    if solver not in ("ridge", "lstsq"):
        raise ValueError(f"solver {solver!r} is not known; choose 'ridge' or 'lstsq'")
    c = xtx.shape[0]
    if tokens is not None and tokens < c:
        warnings.warn(
            f"{what}: {tokens} calibration tokens for hidden size {c}, so XᵀX has rank at most {tokens} < {c} and "
            f"the least-squares problem is under-determined; using the minimum-norm solution. At least {c} tokens "
            f"(data.calibration.num_samples × seq_len, padding excluded) would be enough for a full-rank fit; "
            f"several times {c} for a good one",
            RankDeficientWarning,
            stacklevel=2,
        )
        return solve_lstsq(xtx, xtd)
    return solve_ridge(xtx, xtd, ridge) if solver == "ridge" else solve_lstsq(xtx, xtd)


def _check(xtx: torch.Tensor, xtd: torch.Tensor, ridge: float | None = None) -> torch.Tensor | None:
    """Refuse statistics that are not float64 or do not match; with `ridge`, ε = ridge · tr(A)/C."""
    if xtx.dtype != torch.float64 or xtd.dtype != torch.float64:
        raise TypeError(f"solve in float64 (got {xtx.dtype} and {xtd.dtype}); half precision has no linalg")
    if xtx.ndim != 2 or xtx.shape[0] != xtx.shape[1] or xtd.shape[0] != xtx.shape[0]:
        raise ValueError(f"shapes do not match: XᵀX {tuple(xtx.shape)}, XᵀD {tuple(xtd.shape)}")
    if ridge is None:
        return None
    eps = ridge * torch.trace(xtx) / xtx.shape[0]
    if not torch.isfinite(eps) or eps < 0:
        raise ValueError(f"statistics are not finite or not positive semi-definite (trace {float(torch.trace(xtx))})")
    return eps
