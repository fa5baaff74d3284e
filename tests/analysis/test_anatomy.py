"""Operator anatomy on hand-made matrices."""

import pytest
import torch

from ghostdistill.analysis import operator_anatomy


def _random(c=12, seed=0):
    return torch.randn(c, c, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_antisymmetric_and_symmetric_operators_have_share_one_and_zero():
    a = _random()
    anti, sym = a - a.T, a + a.T
    got = operator_anatomy(anti)
    assert got["antisym_share_M"] == pytest.approx(1.0, abs=1e-12)
    assert got["distance_to_symmetric"] == pytest.approx(1.0, abs=1e-12)
    # W = I + K: the identity is symmetric, so W's share is ‖K‖² / (C + ‖K‖²) (I ⟂ K in Frobenius).
    k2 = float((anti / 1).square().sum())
    assert got["antisym_share_W"] == pytest.approx(k2 / (12 + k2), rel=1e-12)
    assert operator_anatomy(sym)["antisym_share_M"] == pytest.approx(0.0, abs=1e-15)
    assert operator_anatomy(torch.zeros(5, 5))["antisym_share_M"] == 0.0


def test_mixed_operator_share_and_spectrum():
    a = _random(seed=1)
    s, k = (a + a.T) / 2, (a - a.T) / 2
    m = s + 3 * k
    got = operator_anatomy(m, top=4)
    expected = float((3 * k).square().sum() / m.square().sum())
    assert got["antisym_share_M"] == pytest.approx(expected, rel=1e-12)
    sv = torch.linalg.svdvals(m)
    assert got["singular_values"] == pytest.approx(sv.tolist(), rel=1e-12)
    assert got["top_singular_values"] == pytest.approx(sv[:4].tolist(), rel=1e-12)
    assert got["norm_M"] == pytest.approx(float(m.norm()), rel=1e-12)
    # A rank-one M has effective rank 1; a multiple of the identity has effective rank C.
    u = torch.randn(12, 1, dtype=torch.float64)
    assert operator_anatomy(u @ u.T)["effective_rank_M"] == pytest.approx(1.0, rel=1e-9)
    assert operator_anatomy(0.3 * torch.eye(12))["effective_rank_M"] == pytest.approx(12.0, rel=1e-9)


def test_non_square_is_refused():
    with pytest.raises(ValueError, match="square"):
        operator_anatomy(torch.zeros(3, 4))
