"""Tests for ghostdistill.methods.hadamard.

Dense float64 matmuls of 8192² cost tens of seconds on the 2-core CI boxes,
so full ``H @ H.T`` checks stop at 2048 and larger orders are checked with a
random probe: for any nonzero M, ``M x != 0`` almost surely for Gaussian x.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ghostdistill.methods.hadamard import (
    MAX_BASE_ORDER,
    hadamard_matrix,
    has_hadamard,
    supported_base_orders,
)

# Powers of two, every construction path (Paley I/II over primes and prime
# powers, doubling, Kronecker) and common LLM widths up to 2048.
# fmt: off
FULL_CHECK_SIZES = [
    1, 2, 4, 8, 12, 20, 24, 28, 36, 40, 44, 52, 60, 100, 108, 344, 368,
    576, 768, 896, 1024, 1152, 1280, 2048,
]
# fmt: on
PROBE_SIZES = [3072, 5120, 8192]
# Hidden / intermediate widths of common LLMs; building them all would dominate
# the runtime, and they share the kron(Sylvester, base) path tested above.
# fmt: off
LLM_WIDTHS = [
    1536, 1792, 2304, 2560, 3584, 6144, 7168, 4864, 8960, 11008, 13824, 14336,
    18944, 27648, 28672, 29568, 53248,
]
# fmt: on
# Odd parts 23, 29, 39, 59 and 67 have no base order <= 1024 in our constructions.
UNSUPPORTED_SIZES = [3, 6, 10, 14, 18, 92, 116, 156, 184, 236 * 32, 268 * 16]


def _exact_scale(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(1.0 / math.sqrt(n), dtype=torch.float64).to(dtype)


def _assert_entries_exact(H: torch.Tensor, n: int) -> None:
    assert H.shape == (n, n)
    assert bool((H.abs() == _exact_scale(n, H.dtype)).all())


@pytest.mark.parametrize("n", FULL_CHECK_SIZES)
def test_orthonormal_full(n: int) -> None:
    H = hadamard_matrix(n)
    assert H.dtype == torch.float64
    _assert_entries_exact(H, n)
    err = (H @ H.T - torch.eye(n, dtype=torch.float64)).abs().max().item()
    assert err < 1e-10


@pytest.mark.parametrize("n", PROBE_SIZES)
def test_orthonormal_probe(n: int) -> None:
    H = hadamard_matrix(n)
    _assert_entries_exact(H, n)
    x = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    # (x.T @ H).T instead of H.T @ x: the transposed-left matmul path is ~10x
    # slower on CPU.
    y = H @ (x.T @ H).T
    assert (y - x).abs().max().item() < 1e-10


def test_all_small_base_orders_are_hadamard() -> None:
    # Every construction path up to 256, plus the largest Paley I/II orders, checked
    # on the integer ±1 matrix; float64 products of ±1 entries are exact here.
    for m in [m for m in supported_base_orders() if m <= 256] + [924, 1020]:
        S = torch.round(hadamard_matrix(m) * math.sqrt(m))
        assert bool((S.abs() == 1).all()), m
        assert torch.equal(S @ S.T, m * torch.eye(m, dtype=torch.float64)), m


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [12, 36, 1024, 1280])
def test_dtype_honoured(n: int, dtype: torch.dtype) -> None:
    H = hadamard_matrix(n, dtype=dtype)
    assert H.dtype == dtype
    _assert_entries_exact(H, n)
    assert torch.equal(torch.sign(H).double(), torch.sign(hadamard_matrix(n)))


def test_non_float_dtype_rejected() -> None:
    with pytest.raises(TypeError, match="dtype"):
        hadamard_matrix(12, dtype=torch.int32)


@pytest.mark.parametrize("n", [1, 12, 24, 1024, 1536])
def test_cache_not_mutable_through_result(n: int) -> None:
    first = hadamard_matrix(n)
    reference = first.clone()
    first.zero_()
    again = hadamard_matrix(n)
    assert torch.equal(again, reference)
    assert again.data_ptr() != first.data_ptr()


@pytest.mark.parametrize("n", UNSUPPORTED_SIZES)
def test_unsupported_size_raises(n: int) -> None:
    assert not has_hadamard(n)
    with pytest.raises(ValueError) as info:
        hadamard_matrix(n)
    msg = str(info.value)
    assert f"order {n} " in msg
    assert "12, 20, 28, 36" in msg  # lists what is valid
    assert "diag" in msg
    # The suggested padded size must really be supported.
    nxt = int(msg.split("next supported order is ")[1].split(":")[0])
    assert nxt > n and has_hadamard(nxt)


@pytest.mark.parametrize("n", [0, -4])
def test_nonpositive_size_raises(n: int) -> None:
    assert not has_hadamard(n)
    with pytest.raises(ValueError, match=str(n)):
        hadamard_matrix(n)


@pytest.mark.parametrize("n", [4.0, "8", True, None])
def test_non_integer_size_raises(n: object) -> None:
    with pytest.raises(TypeError, match="integer"):
        hadamard_matrix(n)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="integer"):
        has_hadamard(n)  # type: ignore[arg-type]


def test_integer_like_sizes_accepted() -> None:
    assert torch.equal(hadamard_matrix(np.int64(12)), hadamard_matrix(12))


@pytest.mark.parametrize("n", LLM_WIDTHS)
def test_llm_widths_supported(n: int) -> None:
    assert has_hadamard(n)


def test_13824_is_supported() -> None:
    # 13824 = 27·512 looks unsupported, but 108 = 107 + 1 (Paley I), so it is 108·128.
    assert 108 in supported_base_orders()
    assert has_hadamard(13824)


def test_supported_base_orders_shape() -> None:
    bases = supported_base_orders()
    assert isinstance(bases, tuple)
    assert bases[:8] == (1, 12, 20, 28, 36, 44, 52, 60)
    assert list(bases) == sorted(set(bases))
    assert max(bases) <= MAX_BASE_ORDER
    for m in bases:
        assert has_hadamard(m)
        # Minimal per odd part: halving a base order leaves the supported set.
        assert m == 1 or not has_hadamard(m // 2)


def test_has_hadamard_agrees_with_construction() -> None:
    """has_hadamard(n) is true exactly when hadamard_matrix(n) builds an orthonormal ±1/√n matrix."""
    for n in range(1, 301):
        if has_hadamard(n):
            H = hadamard_matrix(n)
            assert torch.allclose(H @ H.T, torch.eye(n, dtype=H.dtype), atol=1e-10), n
            assert torch.allclose(H.abs(), torch.full_like(H, 1 / math.sqrt(n))), n
        else:
            with pytest.raises(ValueError):
                hadamard_matrix(n)
        # No Hadamard matrix of order n > 2 with n not divisible by 4 exists.
        if n > 2 and n % 4:
            assert not has_hadamard(n), n
