"""Study: variants of `rotation_anchored` that still fold, on a plan given on the command line (not the product).

Each variant is registered here as a method and fitted by the product's own `fit`, beside `rotation_anchored`,
so every number comes from the same run (same statistics, sequential fits, evaluation):

- `rotation_hybrid`: anchor u only at a gap whose first positions are massive at its end (`counts.massive_first`
  > 0: ‖x_post‖ over 20× the batch median), the free Procrustes elsewhere;
- `anch_norm`: the anchored Q with c = √(Σ w²‖y‖² / Σ w²‖x‖²) (the tokens' norms matched) instead of least
  squares' c = tr(QᵀM)/tr(A), which shrinks c where the fit is poor;
- `anch_k2`, `anch_k4`: Q fixes a k-dimensional subspace, u and the top eigenvectors of the first positions'
  Σ w² xᵀx (orthonormalised), instead of u alone.

Run, with the held-out C4 documents 1000–1999 as a second evaluation source (the choice is made on it, not on
WikiText-2):

    .venv/bin/python scripts/studies/rotation_variants.py fit --config configs/studies/stock/smollm2_stock.yaml \\
        --model.plan.layers '[3,4,5,6,12,13,14,15,16,17,18]' \\
        --model.recovery '[{name: rotation_anchored, method: rotation_anchored}, {name: rotation_hybrid, method: rotation_hybrid}, {name: anch_norm, method: anch_norm}, {name: anch_k2, method: anch_k2}, {name: anch_k4, method: anch_k4}]' \\
        --data.evaluation.sources '[{name: wikitext2, source: ../shared/data/wikitext-2-raw/wiki.test.raw, join: ""}, {name: c4held, source: ../shared/data/c4_validation_sample/c4_validation_2k.jsonl.gz, first_document: 1000, max_documents: 1000}]' \\
        --trainer.default_root_dir runs/rotation_variants

Measured: docs/results/stock.md, "What did not work".
"""

from __future__ import annotations

import sys

import torch

from ghostdistill.methods.interface import register
from ghostdistill.methods.rotation import (
    RotationAnchored,
    _scale_denominator,
    anchored_procrustes,
    first_direction,
    procrustes,
)


def subspace_procrustes(xtx: torch.Tensor, xty: torch.Tensor, basis: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(c, Q) with Q orthogonal fixing every column of `basis` (C × k, orthonormal): Q = UUᵀ + B·R·Bᵀ, R the
    Procrustes of BᵀMB on the complement B; c = tr(QᵀM)/tr(A) (float64)."""
    xtx, xty = xtx.double(), xty.double()
    full, _ = torch.linalg.qr(basis.double(), mode="complete")
    k = basis.shape[1]
    fixed, b = full[:, :k], full[:, k:]
    left, _, right = torch.linalg.svd(b.T @ xty @ b)
    q = fixed @ fixed.T + b @ (left @ right) @ b.T
    return float(torch.trace(q.T @ xty)) / _scale_denominator(xtx), q


class Hybrid(RotationAnchored):
    name = "rotation_hybrid"

    def solve(self, xtx, xty, stats):
        if stats.counts.massive_first > 0:
            return anchored_procrustes(xtx, xty, first_direction(stats))
        return procrustes(xtx, xty)


class NormScale(RotationAnchored):
    name = "anch_norm"

    def solve(self, xtx, xty, stats):
        _, q = anchored_procrustes(xtx, xty, first_direction(stats))
        keys = stats.group_keys("weighted", include_first=True)
        # Σ w²‖y‖² = tr(A) + 2·tr(B) + Σ w²‖d‖² with y = x + d.
        yy = sum(float(torch.trace(stats.xtx[k]) + 2 * torch.trace(stats.xtd[k]) + stats.scalars[k][1]) for k in keys)
        xx = sum(float(torch.trace(stats.xtx[k])) for k in keys)
        return (yy / xx) ** 0.5, q


class Subspace(RotationAnchored):
    def __init__(self, k: int) -> None:
        self.k = k
        self.name = f"anch_k{k}"

    def solve(self, xtx, xty, stats):
        u = first_direction(stats)
        top = torch.linalg.eigh(stats.xtx["weighted_first"].double())[1][:, -self.k :]
        basis, _ = torch.linalg.qr(torch.cat([u[:, None], top], 1))
        return subspace_procrustes(xtx, xty, basis[:, : self.k])


for variant in (Hybrid(), NormScale(), Subspace(2), Subspace(4)):
    register(variant)

if __name__ == "__main__":
    from ghostdistill.cli import entry

    sys.argv = ["ghostdistill", *sys.argv[1:]]
    entry()
