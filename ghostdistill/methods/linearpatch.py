"""LinearPatch (Chen et al. 2025): a symmetric operator W = H·diag(s)·Hᵀ per gap.

H is an orthonormal Hadamard matrix (`methods.hadamard`: Sylvester and Paley constructions); the
rotation spreads the few outlier channels over all channels before a per-channel scaling
s_j = mean|X_post H|_j / mean|X_pre H|_j. `variant: diag` uses H = I (scaling in the plain basis).
W is symmetric by construction, which is exactly what the ghost operator is not restricted to.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.plan import Gap
from .family import FamilyFacts
from .hadamard import hadamard_matrix, has_hadamard
from .interface import GapFit, GapTaps, Method, Ordered, operator_of, register


@functools.lru_cache(maxsize=2)
def shared_hadamard(hidden_size: int, device: torch.device) -> torch.Tensor:
    """One read-only H per size and device for every collector: the repair-aware criteria hold a collector
    per candidate gap, and a copy each would cost 128 MiB per candidate at C = 4096 (float64)."""
    return hadamard_matrix(hidden_size).to(device)


class LinearPatchStatistics:
    """Per-channel mean magnitudes of X_pre and X_post, in the Hadamard-rotated basis and in the plain one."""

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        z = lambda: torch.zeros(hidden_size, dtype=torch.float64, device=device)  # noqa: E731
        self.hadamard = shared_hadamard(hidden_size, torch.device(device)) if has_hadamard(hidden_size) else None
        self.sums = {"pre": z(), "post": z(), "pre_rot": z(), "post_rot": z()}
        self.tokens = 0

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        keep = taps.mask.bool()
        x = taps.x_pre[keep].to(torch.float64)
        y = taps.x_post[keep].to(torch.float64)
        self.sums["pre"] += x.abs().sum(0)
        self.sums["post"] += y.abs().sum(0)
        if self.hadamard is not None:
            self.sums["pre_rot"] += (x @ self.hadamard).abs().sum(0)
            self.sums["post_rot"] += (y @ self.hadamard).abs().sum(0)
        self.tokens += x.shape[0]

    def state_dict(self) -> dict:
        return {"sums": self.sums, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: v.to(torch.float64) for k, v in state["sums"].items()}
        self.tokens = state["tokens"]


@dataclass
class LinearPatchConfig(Ordered):
    """`linearpatch`'s keys (a hidden size without a Hadamard matrix is refused before calibration: `supports`).

    Args:
        variant: ``rotate`` (Hadamard; default) or ``diag`` (per-channel scaling only).
    """

    variant: Literal["rotate", "diag"] = "rotate"


class LinearPatch(Method):
    name = "linearpatch"
    config = LinearPatchConfig
    card = "LinearPatch: W = H·diag(s)·Hᵀ at each gap (H an orthonormal Hadamard matrix)"
    statistics = LinearPatchStatistics

    def supports(self, cfg: LinearPatchConfig, family: FamilyFacts) -> str | None:
        if cfg.variant == "diag" or has_hadamard(family.hidden_size):
            return None
        nxt = next(n for n in range(family.hidden_size + 1, 2 * family.hidden_size + 2) if has_hadamard(n))
        return (
            f"variant 'rotate' needs a Hadamard matrix of the hidden size {family.hidden_size}, and none is known to "
            f"ghostdistill (the next supported order is {nxt}): use variant 'diag'"
        )

    def fit(self, cfg: LinearPatchConfig, gap: Gap, stats: LinearPatchStatistics, hidden_size: int) -> GapFit:
        """W = H·diag(s)·Hᵀ with s_j = mean|X_post H|_j / mean|X_pre H|_j (H = I for `diag`)."""
        sums = stats.sums
        if cfg.variant == "diag":
            return GapFit(operator=operator_of(torch.diag(sums["post"] / sums["pre"].clamp_min(1e-12))))
        h = stats.hadamard
        if h is None:
            hadamard_matrix(hidden_size)  # raises for a hidden size with no known Hadamard matrix, naming it
        scale = sums["post_rot"] / sums["pre_rot"].clamp_min(1e-12)
        w = (h * scale) @ h.T
        w = 0.5 * (w + w.T)  # exact symmetry despite rounding
        return GapFit(operator=operator_of(w))


register(LinearPatch())
