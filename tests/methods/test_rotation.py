"""The rotation methods: W = c·Q per gap from weighted orthogonal Procrustes on ghost's statistics."""

from __future__ import annotations

import pytest
import torch

from ghostdistill.core.plan import Gap
from ghostdistill.methods import GapTaps, RecoveryConfig, fit_gap, get_method, make_collectors, validate_recovery
from ghostdistill.methods.ghost import GhostStatistics
from ghostdistill.methods.rotation import procrustes

C = 8
GAP = Gap(2, 4)


def _orthogonal(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(C, C, generator=g, dtype=torch.float64))
    return q


def _taps(c: float, q: torch.Tensor, noise: float = 0.0, seed: int = 0) -> GapTaps:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 40, C, generator=g, dtype=torch.float64) * 3
    x[:, 0] *= 30  # a massive first position
    post = c * x @ q + noise * torch.randn(3, 40, C, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 40)
    mask[2, 30:] = 0
    first = torch.zeros(3, 40, dtype=torch.bool)
    first[:, 0] = True
    return GapTaps(x, post, mask, first)


def _fitted(method: str, taps: GapTaps):
    cfg = RecoveryConfig(name=method, method=method)
    stats = make_collectors({method}, C, "cpu", [cfg])[method]
    stats.update(taps)
    return fit_gap(cfg, GAP, stats, C).operator, stats


@pytest.mark.parametrize("method", ["rotation", "rotation_through"])
def test_fit_recovers_an_exact_scaled_rotation(method):
    q, c = _orthogonal(1), 1.7
    op, _ = _fitted(method, _taps(c, q))
    w = op.delta.double() + torch.eye(C, dtype=torch.float64)
    # The operator is stored in float32; the float64 solve itself is exact to 1e-8.
    assert torch.allclose(w, c * q, atol=1e-6)
    stats = GhostStatistics(C, groups=("weighted_rest", "weighted_first"))
    stats.update(_taps(c, q))
    xtx, xtd = stats.normal_equations("weighted", include_first=method == "rotation_through")
    c_fit, q_fit = procrustes(xtx, xtx + xtd)
    assert abs(c_fit - c) < 1e-8 and torch.allclose(q_fit, q, atol=1e-8)


def test_procrustes_is_the_best_scaled_rotation():
    """With noise, no nearby scaled rotation does better on the weighted objective."""
    taps = _taps(0.8, _orthogonal(2), noise=2.0)
    stats = GhostStatistics(C, groups=("weighted_rest",))
    stats.update(taps)
    xtx, xtd = stats.normal_equations("weighted", include_first=False)
    xty = xtx + xtd
    c, q = procrustes(xtx, xty)

    def err(c, q):  # Σ w²‖x·cQ‖² − 2 Σ w² tr(cQᵀ xᵀy) (+ const)
        return float(c * c * torch.trace(q.T @ xtx @ q) - 2 * c * torch.trace(q.T @ xty))

    best = err(c, q)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        s = torch.randn(C, C, generator=g, dtype=torch.float64) * 1e-2
        near = torch.linalg.matrix_exp(s - s.T)  # a rotation near the identity
        assert err(c * (1 + 1e-2 * float(torch.randn(1, generator=g))), q @ near) >= best - 1e-9
    assert torch.allclose(q.T @ q, torch.eye(C, dtype=torch.float64), atol=1e-10)


def test_first_positions_apart_or_through():
    q, c = _orthogonal(4), 1.3
    apart, stats = _fitted("rotation", _taps(c, q))
    assert apart.separate_first and not apart.fused
    torch.testing.assert_close(apart.first_shift.double(), stats.first_shift().float().double())
    assert stats.groups == ("weighted_rest",)
    through, stats = _fitted("rotation_through", _taps(c, q))
    assert not through.separate_first and through.fused and through.inference_parameters() == 0
    assert stats.groups == ("weighted_rest", "weighted_first")
    assert apart.inference_parameters() == C * C + C


def test_registry_keys_and_folding():
    assert not get_method("rotation").folds and get_method("rotation_through").folds
    for method in ("rotation", "rotation_through"):
        cfg = RecoveryConfig(name=method, method=method)
        assert cfg.settings() == {"name": method, "method": method, "order": "sequential"}
        validate_recovery([cfg])
        with pytest.raises(ValueError, match="key 'ridge' is not read"):
            validate_recovery([RecoveryConfig(name=method, method=method, ridge=1e-3)])
    with pytest.raises(NotImplementedError):
        get_method("rotation").fold([], GAP, None)
    identity = get_method("rotation_through").identity(RecoveryConfig(method="rotation_through"), C)
    x = torch.randn(2, 5, C)
    torch.testing.assert_close(identity.operator(x), x)
