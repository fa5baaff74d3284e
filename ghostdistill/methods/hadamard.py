"""Orthonormal Hadamard matrices for LinearPatch-style channel rotations.

Why LinearPatch's ``W = H diag(s) H^T`` rotates by ``H``: `methods.linearpatch`. Every entry of ``H`` is
``±1/sqrt(n)``; ``H`` is orthonormal, so ``W`` is symmetric with eigenvalues exactly ``s``.

Hadamard matrices exist only for orders 1, 2 and multiples of 4, and no construction is known for every
multiple of 4. This module builds them from classical constructions only:

* Sylvester doubling, ``H_2n = [[H, H], [H, -H]]``;
* Paley I, order ``q + 1`` for a prime power ``q ≡ 3 (mod 4)``;
* Paley II, order ``2(q + 1)`` for a prime power ``q ≡ 1 (mod 4)``;
* Kronecker products of orders built so far.

Any supported order is ``m·2^k`` for a *base order* ``m`` (:func:`supported_base_orders`), which covers the
hidden and intermediate sizes of common LLMs (e.g. 576 = 36·16, 3584 = 28·128, 13824 = 108·128, 18944 = 148·128,
29568 = 924·32).
"""

from __future__ import annotations

import functools
import math
import operator

import torch

__all__ = ["hadamard_matrix", "has_hadamard", "supported_base_orders"]

# Base orders are searched up to this bound: every odd factor of real LLM widths has a base order below it,
# and building and self-checking any base matrix stays in the millisecond range.
MAX_BASE_ORDER = 1024

# Only the base orders up to this are spelled out in error messages: the full tuple would bury the error.
_LISTED_IN_ERRORS = 256


def _as_order(n: object) -> int:
    # bool is an int subclass, but hadamard_matrix(True) is surely a bug.
    if isinstance(n, bool):
        raise TypeError(f"Hadamard order must be an integer, got bool {n!r}")
    try:
        return operator.index(n)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"Hadamard order must be an integer, got {type(n).__name__} {n!r}") from None


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _prime_power(q: int) -> tuple[int, int] | None:
    """Return ``(p, k)`` with ``q == p**k`` for prime ``p``, else ``None``."""
    if q < 2:
        return None
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    k = 0
    while q % p == 0:
        q //= p
        k += 1
    return (p, k) if q == 1 else None


@functools.lru_cache(maxsize=None)
def _quadratic_character_of_differences(q: int) -> torch.Tensor:
    """``Q[i, j] = chi(a_i - a_j)`` over GF(q), the Jacobsthal matrix.

    GF(p^k) is realised as polynomials mod a *primitive* polynomial f: if the residue class of x has multiplicative
    order exactly q - 1 then the quotient ring has q - 1 units, so it is a field, and x generates its unit group.
    The quadratic character is then the parity of the discrete log, which avoids any general finite-field machinery.
    """
    pk = _prime_power(q)
    assert pk is not None and pk[0] != 2
    p, k = pk
    weights = [p**i for i in range(k)]

    def encode(coeffs: list[int]) -> int:
        return sum(c * w for c, w in zip(coeffs, weights))

    log: list[int] | None = None
    # f = x^k + f_{k-1} x^{k-1} + ... + f_0, enumerated by its low coefficients.
    for low_code in range(1, q):
        low = [(low_code // w) % p for w in weights]
        if low[0] == 0:  # f(0) == 0 makes x a zero divisor
            continue
        table = [-1] * q
        elem = [1] + [0] * (k - 1)
        for i in range(q - 1):
            code = encode(elem)
            if table[code] != -1:
                break  # x has order < q - 1: f is not primitive
            table[code] = i
            top = elem[-1]
            elem = [0] + elem[:-1]  # multiply by x ...
            elem = [(e - top * c) % p for e, c in zip(elem, low)]  # ... mod f
        else:
            if encode(elem) == 1:
                log = table
                break
    if log is None:  # pragma: no cover - primitive polynomials always exist
        raise RuntimeError(f"no primitive polynomial found for GF({q})")

    chi = torch.tensor([0] + [1 - 2 * (log[c] % 2) for c in range(1, q)], dtype=torch.int64)
    digits = torch.tensor([[(c // w) % p for w in weights] for c in range(q)], dtype=torch.int64)
    w = torch.tensor(weights, dtype=torch.int64)
    diff = ((digits[:, None, :] - digits[None, :, :]) % p) @ w
    return chi[diff]


def _conference(q: int, column: int) -> torch.Tensor:
    """The Jacobsthal matrix Q of GF(q) bordered by a row of ones and a column of `column`, 0 in the corner."""
    C = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    C[0, 1:] = 1
    C[1:, 0] = column
    C[1:, 1:] = _quadratic_character_of_differences(q)
    return C


def _paley1(q: int) -> torch.Tensor:
    # q ≡ 3 (mod 4) makes chi(-1) = -1, so Q is skew and S = [[0, 1], [-1, Q]] is a skew conference matrix:
    # (I + S)(I + S)^T = I + S S^T = (q + 1) I.
    return _conference(q, -1) + torch.eye(q + 1, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    # q ≡ 1 (mod 4) makes Q symmetric, giving a symmetric conference matrix C (C C^T = q I) that is lifted
    # to a Hadamard matrix of twice its order.
    off = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    on = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    return torch.kron(_conference(q, 1), off) + torch.kron(torch.eye(q + 1, dtype=torch.int64), on)


@functools.lru_cache(maxsize=None)
def _recipe(n: int) -> tuple | None:
    """How to build a Hadamard matrix of order n, or None if we cannot."""
    if n in (1, 2):
        return ("sylvester", n)
    if n % 4:
        return None
    if _is_pow2(n):
        return ("sylvester", n)
    # n ≡ 0 (mod 4) already makes q = n - 1 ≡ 3 (mod 4); Paley II also needs n/2 - 1 ≡ 1 (mod 4): n ≡ 4 (mod 8).
    if _prime_power(n - 1) is not None:
        return ("paley1", n - 1)
    if n % 8 == 4 and _prime_power(n // 2 - 1) is not None:
        return ("paley2", n // 2 - 1)
    if _recipe(n // 2) is not None:
        return ("kron", 2, n // 2)
    for a in range(4, math.isqrt(n) + 1, 4):
        if n % a == 0 and _recipe(a) is not None and _recipe(n // a) is not None:
            return ("kron", a, n // a)
    return None


def _sylvester(n: int) -> torch.Tensor:
    if n > 64:
        # H_{2^(a+b)} = H_{2^a} ⊗ H_{2^b}: one kron is several times faster than repeated concatenation
        # once the matrix no longer fits in cache.
        k = n.bit_length() - 1
        return torch.kron(_sylvester(1 << (k // 2)), _sylvester(1 << (k - k // 2)))
    H = torch.ones(1, 1, dtype=torch.int8)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@functools.lru_cache(maxsize=None)
def _signs(n: int) -> torch.Tensor:
    """Unnormalised ±1 Hadamard matrix of a buildable order n (`_recipe`; int8, cached, do not mutate)."""
    recipe = _recipe(n)
    kind, *args = recipe
    build = {"sylvester": _sylvester, "paley1": _paley1, "paley2": _paley2}.get(kind)
    H = build(*args).to(torch.int8) if build else torch.kron(_signs(args[0]), _signs(args[1]))
    # Non-power-of-two orders come from number-theoretic constructions; a one-off exact check turns any
    # construction bug into a loud failure instead of a silently non-orthogonal rotation.
    if n <= MAX_BASE_ORDER and not _is_pow2(n):
        # Dot products are integers of magnitude <= n < 2^24, exact in float32.
        Hf = H.to(torch.float32)
        gram = Hf @ Hf.T
        if not torch.equal(gram, n * torch.eye(n, dtype=torch.float32)):
            raise RuntimeError(f"internal error: {recipe} is not Hadamard")
    return H


@functools.lru_cache(maxsize=1)
def supported_base_orders() -> tuple[int, ...]:
    """Smallest buildable order for each odd part, up to ``MAX_BASE_ORDER``.

    An order ``n`` is supported iff ``n == m * 2**k`` for some ``m`` in this tuple and ``k >= 0``. ``1`` is
    included, standing for the powers of two.
    """
    # m is a base order only if m/2 is not buildable; otherwise m doubles a smaller base order with its odd part.
    buildable = range(1, MAX_BASE_ORDER + 1)
    return tuple(m for m in buildable if _recipe(m) is not None and not (m % 2 == 0 and _recipe(m // 2) is not None))


def _base_for(n: int) -> int | None:
    odd = n >> ((n & -n).bit_length() - 1)
    for m in supported_base_orders():
        if m >> ((m & -m).bit_length() - 1) == odd:
            return m if n % m == 0 else None
    return None


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard_matrix` can build an order-``n`` matrix."""
    n = _as_order(n)
    return n >= 1 and _base_for(n) is not None


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal Hadamard matrix of order ``n``: entries ``±1/sqrt(n)``, ``H @ H.T == I``.

    The result is a fresh tensor on the CPU; the caller may modify it freely. Raises ``ValueError`` if no
    construction for ``n`` is known (the message lists the supported orders) and ``TypeError`` if ``n`` is not
    an integer or ``dtype`` is not a floating/complex dtype.
    """
    n = _as_order(n)
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if n < 1:
        raise ValueError(f"Hadamard order must be >= 1, got {n}")
    base = _base_for(n)
    if base is None:
        bases = supported_base_orders()
        listed = [m for m in bases[1:] if m <= _LISTED_IN_ERRORS]
        nxt = next(k for k in range(n + 1, 2 * n + 2) if has_hadamard(k))
        raise ValueError(
            f"no Hadamard matrix of order {n} is known to ghostdistill; supported "
            f"orders are 1, 2, 4, ... (powers of two) and m·2^k for m in "
            f"{{{', '.join(map(str, listed))}, ... ({len(bases) - 1 - len(listed)} more up to "
            f"{MAX_BASE_ORDER}, see ghostdistill.methods.hadamard.supported_base_orders())}}; "
            f"the next supported order is {nxt}: pad the hidden size or use "
            f"linearpatch variant 'diag'"
        )
    # Only the small base matrix is cached; the Sylvester factor is rebuilt per call because caching e.g. an
    # 8192² or 32768² sign matrix would pin 64 MiB / 1 GiB for the life of the process.
    signs = _signs(base)
    if n > base:
        signs = torch.kron(_sylvester(n // base), signs)
    # Round 1/sqrt(n) to the target dtype once and multiply ±1 by it, so every entry is exactly
    # ±round(1/sqrt(n)) even for half types whose arithmetic runs in float32 (a float scalar would be rounded
    # twice there). The cast allocates a fresh tensor, so the cached ±1 matrices can never be mutated
    # through the return value.
    scale = torch.tensor(1.0 / math.sqrt(n), dtype=torch.float64).to(dtype)
    return signs.to(dtype).mul_(scale)
