import pytest
import torch

from ghostdistill.core.solver import solve, solve_lstsq, solve_ridge


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
