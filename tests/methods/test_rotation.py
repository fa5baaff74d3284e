"""The rotation methods: W = c·Q per gap from weighted orthogonal Procrustes on ghost's statistics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ghostdistill.core.plan import Gap
from ghostdistill.methods import GapTaps, RecoveryConfig, fit_gap, get_method, make_collectors, validate_recovery
from ghostdistill.methods.ghost import GhostStatistics
from ghostdistill.methods.rotation import anchored_procrustes, first_direction, procrustes

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


def _fixing(u: torch.Tensor, seed: int) -> torch.Tensor:
    """A random rotation Q with u·Q = u: the identity on u, a random rotation on its complement."""
    basis, _ = torch.linalg.qr(u[:, None], mode="complete")
    b = basis[:, 1:]
    return torch.outer(u, u) + b @ _orthogonal_of(C - 1, seed) @ b.T


def _orthogonal_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


def _massive_taps(c: float, q: torch.Tensor, u: torch.Tensor, noise: float = 0.0, seed: int = 0) -> GapTaps:
    """As `_taps`, but the first position is a massive activation along u (as SmolLM2's channel 507)."""
    taps = _taps(c, q, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = taps.x_pre.clone()
    x[:, 0] = 300 * u + torch.randn(3, C, generator=g, dtype=torch.float64)
    post = c * x @ q + noise * torch.randn(x.shape, generator=g, dtype=torch.float64)
    return GapTaps(x, post, taps.mask, taps.first)


def _unit(seed: int) -> torch.Tensor:
    u = torch.randn(C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return u / u.norm()


def test_anchored_fit_recovers_a_scaled_rotation_that_fixes_u():
    u = _unit(5)
    q, c = _fixing(u, 6), 1.4
    assert torch.allclose(u @ q, u, atol=1e-12)
    op, stats = _fitted("rotation_anchored", _massive_taps(c, q, u))
    assert not op.separate_first and op.fused and op.inference_parameters() == 0
    assert stats.groups == ("weighted_rest", "weighted_first")
    # u from the statistics: the first positions' direction (their noise is 1/300 of the massive part).
    u_fit = first_direction(stats)
    assert float(u_fit @ u) > 1 - 1e-4
    xtx, xtd = stats.normal_equations("weighted", include_first=True)
    c_fit, q_fit = anchored_procrustes(xtx, xtx + xtd, u)
    assert abs(c_fit - c) < 1e-8 and torch.allclose(q_fit, q, atol=1e-8)
    # The stored operator is the float32 copy of c·Q with the fitted u.
    c_op, q_op = anchored_procrustes(xtx, xtx + xtd, u_fit)
    w = op.delta.double() + torch.eye(C, dtype=torch.float64)
    assert torch.allclose(w, c_op * q_op, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_anchored_q_is_orthogonal_fixes_u_and_is_the_best_such_rotation(seed):
    """On data whose true map turns u away (a free rotation plus noise): Q stays orthogonal, fixes u exactly,
    no rotation near it that fixes u does better, and the free Procrustes (no constraint) does no worse."""
    u = _unit(10 + seed)
    stats = GhostStatistics(C, groups=("weighted_rest", "weighted_first"))
    stats.update(_massive_taps(0.9, _orthogonal(20 + seed), u, noise=1.0, seed=seed))
    xtx, xtd = stats.normal_equations("weighted", include_first=True)
    xty = xtx + xtd
    c, q = anchored_procrustes(xtx, xty, u)
    eye = torch.eye(C, dtype=torch.float64)
    assert (q.T @ q - eye).abs().max() < 1e-10
    assert (u @ q - u).abs().max() < 1e-10

    def err(c, q):  # Σ w²‖x·cQ‖² − 2 Σ w² tr(cQᵀ xᵀy) (+ const)
        return float(c * c * torch.trace(q.T @ xtx @ q) - 2 * c * torch.trace(q.T @ xty))

    best = err(c, q)
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(u[:, None], mode="complete")
    b = basis[:, 1:]
    for _ in range(20):
        s = torch.randn(C - 1, C - 1, generator=g, dtype=torch.float64) * 1e-2
        near = torch.outer(u, u) + b @ torch.linalg.matrix_exp(s - s.T) @ b.T  # fixes u, near the identity
        assert (u @ (q @ near) - u).abs().max() < 1e-10
        assert err(c * (1 + 1e-2 * float(torch.randn(1, generator=g))), q @ near) >= best - 1e-9
    c_free, q_free = procrustes(xtx, xty)
    assert err(c_free, q_free) <= best + 1e-9
    assert float(u @ q_free @ u) < 1 - 1e-3, "the data should turn u away, or the constraint tests nothing"


def test_anchored_refuses_what_cannot_fold_or_has_no_direction():
    u = _unit(7)
    stats = GhostStatistics(C, groups=("weighted_rest", "weighted_first"))
    stats.update(_massive_taps(1.2, _fixing(u, 8), u))
    xtx, xtd = stats.normal_equations("weighted", include_first=True)
    with pytest.raises(ValueError, match=r"direction u has norm 0"):
        anchored_procrustes(xtx, xtx + xtd, torch.zeros(C))
    # y = −x along u and nothing else: Q cannot turn u over, so the best scale is negative, which no fold writes.
    with pytest.raises(ValueError, match=r"best scale c = -.* is not positive.*rotation_through"):
        anchored_procrustes(torch.outer(u, u), -torch.outer(u, u), u)
    empty = GhostStatistics(C, groups=("weighted_rest", "weighted_first"))
    with pytest.raises(ValueError, match="no first-position tokens"):
        first_direction(empty)
    rest_only = GhostStatistics(C, groups=("weighted_rest",))
    rest_only.update(_massive_taps(1.2, _fixing(u, 8), u))
    with pytest.raises(ValueError, match=r"not \['weighted_first'\]"):
        first_direction(rest_only)
    with pytest.raises(ValueError, match="gap 2-3: no calibration tokens"):
        fit_gap(RecoveryConfig(method="rotation_anchored"), GAP, empty, C)


def test_anchored_registry_keys_and_folding():
    method = get_method("rotation_anchored")
    assert method.folds and method.folds_embedding
    cfg = RecoveryConfig(name="anchored", method="rotation_anchored")
    assert cfg.settings() == {"name": "anchored", "method": "rotation_anchored", "order": "sequential"}
    with pytest.raises(ValueError, match="key 'fit' is not read"):
        validate_recovery([RecoveryConfig(name="a", method="rotation_anchored", fit="plain")])
    identity = method.identity(cfg, C)
    x = torch.randn(2, 5, C)
    torch.testing.assert_close(identity.operator(x), x)


@pytest.mark.parametrize("method", ["rotation_through", "rotation_anchored"])
def test_a_student_trains_within_the_scaled_rotations(method):
    """A student's operator (`student_operator`) starts at the fit to the bit, and wherever its generator and
    scale go, W stays c·Q with Q orthogonal (so it folds: `scaled_rotation` accepts it), and for
    `rotation_anchored` u·Q = u with the fit's u; gradients reach both parameters."""
    from ghostdistill.methods.rotation import ScaledRotationOperator, scaled_rotation

    u = _unit(5)
    op, stats = _fitted(method, _massive_taps(1.4, _fixing(u, 6), u, noise=0.05))
    student = get_method(method).student_operator(copy.deepcopy(op))
    assert isinstance(student, ScaledRotationOperator)
    assert torch.equal(student.delta, op.delta)  # exp(0) = I exactly: the closed form to the bit
    assert {n for n, _ in student.named_parameters()} == {"generator", "log_scale"}
    x = torch.randn(2, 7, C)
    student(x).square().sum().backward()
    assert student.generator.grad.abs().sum() > 0 and student.log_scale.grad.abs() > 0
    with torch.no_grad():
        student.generator.normal_(0, 0.3)  # far from the fit: a turn of order one
        student.log_scale.fill_(0.2)
    c, q, _ = scaled_rotation(student)  # refuses anything off c·Q by more than 1e-4
    c_fit, q_fit, _ = scaled_rotation(op)
    assert abs(c - c_fit * math.exp(0.2)) < 1e-5
    assert float((q - q_fit).abs().max()) > 0.05, "the generator turned Q"
    anchored = method == "rotation_anchored"
    u_fit = first_direction(stats)
    assert torch.allclose(u_fit @ q, u_fit, atol=1e-5) == anchored
    # A checkpoint written when log_scale was 0-dim (before FSDP2 needed it 1-D) loads to the same W.
    old = {k: (v.reshape(()) if k == "log_scale" else v) for k, v in student.state_dict().items()}
    assert old["log_scale"].dim() == 0
    again = get_method(method).student_operator(copy.deepcopy(op))
    again.load_state_dict(old)
    assert again.log_scale.shape == (1,) and torch.equal(again.delta, student.delta)


def test_a_rotation_operator_without_a_fixed_direction_or_with_a_first_shift_is_refused():
    """`rotation` (first positions shifted apart) does not fold, so it has no scaled-rotation student."""
    from ghostdistill.methods.rotation import ScaledRotationOperator

    op, _ = _fitted("rotation", _taps(1.7, _orthogonal(1)))
    assert get_method("rotation").student_operator(op) is op  # the fitted operator itself, trained freely
    with pytest.raises(ValueError, match="no first shift"):
        ScaledRotationOperator(op)


def test_wrong_model_anchored_falls_back_to_rotation_through_without_a_massive_first_position():
    """Issue 39: `rotation_anchored` assumes the first position carries a massive activation to anchor. Where it
    does not (taps whose first position is ordinary; every tiny random model), the gap is fitted as
    `rotation_through` (no fixed direction, no anchor for a student) and the fit's note says so; where it does,
    no note."""
    q, c = _orthogonal(4), 1.3
    ordinary = _taps(c, q)
    ordinary.x_pre[:, 0] /= 30  # undo `_taps`' massive first position
    ordinary.x_post[:, 0] /= 30
    op, stats = _fitted("rotation_anchored", ordinary)
    through, _ = _fitted("rotation_through", ordinary)
    assert stats.counts.massive_first == 0 and stats.counts.first == 3
    assert torch.equal(op.delta, through.delta) and getattr(op, "anchor", None) is None
    fit = fit_gap(RecoveryConfig(name="ra", method="rotation_anchored"), GAP, stats, C)
    assert fit.note.startswith("the first position carries no massive activation (0 of 3 first-position tokens")
    assert fit.note.endswith("fitted as rotation_through (no fixed direction)")
    u = _unit(5)
    massive = _massive_taps(1.4, _fixing(u, 6), u)
    op, stats = _fitted("rotation_anchored", massive)
    assert stats.counts.massive_first == 3 and op.anchor is not None
    assert fit_gap(RecoveryConfig(name="ra", method="rotation_anchored"), GAP, stats, C).note is None


def test_wrong_model_anchored_fallback_on_a_tiny_model_is_in_the_fit_report():
    """On a tiny random LLaMA (no massive first position) the fitted view is rotation_through's, and the fit
    records why (`notes`, which the run logs and results.md shows)."""
    from conftest import random_batches, tiny_model

    from ghostdistill.pipeline.calibrate import calibrate
    from ghostdistill.planning import PlanConfig

    cfgs = [RecoveryConfig(name="ra", method="rotation_anchored"), RecoveryConfig(name="rt", method="rotation_through")]
    plan = PlanConfig(layers=[2, 3], num_layers=None)
    cal = calibrate(tiny_model("llama"), plan, cfgs, random_batches(n=2), log=lambda message: None)
    assert torch.equal(cal.pruned.operators["ra"]["2-3"].delta, cal.pruned.operators["rt"]["2-3"].delta)
    assert cal.fits["ra"]["notes"][0].startswith("gap 2-3: the first position carries no massive activation (0 of")
    assert "notes" not in cal.fits["rt"]
