import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ghostdistill.core.solver import (
    RankDeficientWarning,
    solve,
    solve_lstsq,
    solve_ridge,
    solve_symmetric,
)


def _problem(n=400, c=24, rank=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64) * 50.0
    if rank is not None:
        x = x[:, :rank] @ torch.randn(rank, c, generator=g, dtype=torch.float64)
    m = torch.randn(c, c, generator=g, dtype=torch.float64) * 0.1
    d = x @ m + 0.01 * torch.randn(n, c, generator=g, dtype=torch.float64)
    return x, d, m


def test_ridge_matches_exact_least_squares_for_small_ridge():
    x, d, _ = _problem()
    exact = torch.linalg.lstsq(x, d).solution
    got = solve_ridge(x.T @ x, x.T @ d, ridge=1e-12)
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-8)


def test_ridge_is_scale_aware():
    # Scaling the activations must not change what a given `ridge` means.
    x, d, _ = _problem()
    a = solve_ridge(x.T @ x, x.T @ d, ridge=1e-2)
    b = solve_ridge((1e3 * x).T @ (1e3 * x), (1e3 * x).T @ (1e3 * d), ridge=1e-2)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_lstsq_gives_minimum_norm_solution_when_rank_deficient():
    x, d, _ = _problem(rank=10)
    expected = torch.linalg.pinv(x) @ d
    got = solve_lstsq(x.T @ x, x.T @ d)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    # Any null-space component would only add norm.
    assert got.norm() <= torch.linalg.lstsq(x, d, driver="gelsd").solution.norm() * (1 + 1e-6)


def test_half_precision_and_bad_shapes_rejected():
    x, d, _ = _problem()
    with pytest.raises(TypeError, match="float64"):
        solve((x.T @ x).float(), (x.T @ d).float())
    with pytest.raises(ValueError, match="shapes"):
        solve(torch.eye(3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="'qr'"):
        solve(x.T @ x, x.T @ d, solver="qr")


def _symmetric_brute_force(x: torch.Tensor, d: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """min ||X M − D||² + eps||M||² over symmetric M, as ordinary least squares on the C(C+1)/2 free entries."""
    c = x.shape[1]
    idx = [(i, j) for i in range(c) for j in range(i, c)]
    cols, reg = [], []
    for i, j in idx:
        e = torch.zeros(c, c, dtype=torch.float64)
        e[i, j] = e[j, i] = 1.0
        cols.append((x @ e).reshape(-1))
        reg.append(e.reshape(-1) * eps**0.5)
    g = torch.cat([torch.stack(cols, 1), torch.stack(reg, 1)])
    target = torch.cat([d.reshape(-1), torch.zeros(c * c, dtype=torch.float64)])
    coef = torch.linalg.lstsq(g, target).solution
    m = torch.zeros(c, c, dtype=torch.float64)
    for k, (i, j) in enumerate(idx):
        m[i, j] = m[j, i] = coef[k]
    return m


@pytest.mark.parametrize("ridge", [0.0, 1e-2])
def test_symmetric_solver_matches_brute_force(ridge):
    x, d, _ = _problem(n=120, c=7)
    xtx = x.T @ x
    got = solve_symmetric(xtx, x.T @ d, ridge=ridge)
    torch.testing.assert_close(got, got.T, rtol=0, atol=0)
    expected = _symmetric_brute_force(x, d, eps=float(ridge * torch.trace(xtx) / 7))
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


def test_symmetric_solver_recovers_a_symmetric_truth_and_loses_to_the_free_fit_otherwise():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 10, generator=g, dtype=torch.float64)
    s = torch.randn(10, 10, generator=g, dtype=torch.float64)
    sym, anti = s + s.T, s - s.T
    torch.testing.assert_close(solve_symmetric(x.T @ x, x.T @ (x @ sym), ridge=0.0), sym)
    d = x @ anti  # a purely antisymmetric truth: the best symmetric map explains little of it
    m_sym = solve_symmetric(x.T @ x, x.T @ d, ridge=0.0)
    m_free = solve_lstsq(x.T @ x, x.T @ d)
    assert (x @ m_free - d).norm() < 1e-8 * d.norm()
    assert (x @ m_sym - d).norm() > 0.5 * d.norm()


# ---------------------------------------------------------------- properties (hypothesis)

_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random(seed: int, n: int, c: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g, dtype=torch.float64) * scale, torch.randn(
        c, c, generator=g, dtype=torch.float64
    )


@_settings
@given(
    seed=st.integers(0, 2**31 - 1),
    c=st.integers(1, 24),
    extra=st.integers(0, 40),
    scale=st.floats(1e-3, 1e3),
    solver=st.sampled_from(["ridge", "lstsq"]),
)
def test_full_rank_fit_recovers_the_true_operator(seed, c, extra, scale, solver):
    """D = X M exactly and X full rank (n ≥ C random rows): both solvers give back M."""
    x, m = _random(seed, c + extra, c, scale)
    xtx, xtd = x.T @ x, x.T @ (x @ m)
    cond = float(torch.linalg.cond(x))
    if cond > 1e4:  # a nearly singular draw (n = C): recovery is only as good as its conditioning
        return
    got = solve(xtx, xtd, solver, ridge=1e-12, tokens=c + extra)
    torch.testing.assert_close(got, m, rtol=0, atol=1e-9 * cond**2 * max(1.0, float(m.abs().max())))


@_settings
@given(
    seed=st.integers(0, 2**31 - 1),
    c=st.integers(2, 24),
    n=st.integers(1, 23),
    scale=st.floats(1e-3, 1e3),
    solver=st.sampled_from(["ridge", "lstsq"]),
)
def test_rank_deficient_fit_is_finite_and_minimum_norm(seed, c, n, scale, solver):
    """Fewer tokens than channels: finite, the minimum-norm solution pinv(X)·D, and a warning that says how
    many tokens would be enough."""
    n = min(n, c - 1)
    x, m = _random(seed, n, c, scale)
    d = x @ m
    with pytest.warns(RankDeficientWarning, match=rf"{n} calibration tokens for hidden size {c}.*At least {c} tokens"):
        got = solve(x.T @ x, x.T @ d, solver, tokens=n, what="test gap")
    assert torch.isfinite(got).all()
    expected = torch.linalg.pinv(x) @ d
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * max(1.0, float(expected.abs().max())))
    # It fits the data as well as the true M, with no more norm.
    torch.testing.assert_close(x @ got, d, rtol=1e-4, atol=1e-6 * max(1.0, float(d.abs().max())))
    assert got.norm() <= m.norm() * (1 + 1e-6)


@_settings
@given(
    seed=st.integers(0, 2**31 - 1),
    c=st.integers(1, 16),
    n=st.integers(1, 64),
    factor=st.floats(1e-4, 1e4),
    ridge=st.floats(1e-6, 1.0),
)
def test_scaling_x_and_target_together_leaves_the_ridge_solution_unchanged(seed, c, n, factor, ridge):
    """ε = ridge·tr(XᵀX)/C scales with the data: (sX, sD) gives the same M as (X, D), whatever the rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64)
    d = torch.randn(n, c, generator=g, dtype=torch.float64)
    a = solve_ridge(x.T @ x, x.T @ d, ridge)
    b = solve_ridge((factor * x).T @ (factor * x), (factor * x).T @ (factor * d), ridge)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-9 * max(1.0, float(a.abs().max())))


def test_zero_statistics_give_zero_not_nan():
    """No signal at all (XᵀX = 0): M = 0 (the identity operator), never NaN."""
    z = torch.zeros(4, 4, dtype=torch.float64)
    for solver in ("ridge", "lstsq"):
        got = solve(z, z, solver)
        assert torch.equal(got, torch.zeros_like(got))
