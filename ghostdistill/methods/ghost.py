"""Ghosted Layers: one closed-form linear operator per gap, W = I + M, on the residual stream.

Per gap, M = argmin ‖X_pre M − (X_post − X_pre)‖² from float64 normal equations accumulated over the
calibration tokens (`GhostStatistics`), solved by ridge or minimum-norm least squares
(`core.solver`). The operator x ← x + x·M acts on the residual stream entering the first block after
the gap.

Massive activations: the first token of every sequence carries a huge activation that the removed
blocks create. Fitting W on it bends W for every other token, so the fit variants (`fit`) treat it
apart:

| fit              | W fitted on                                   | first-position tokens at inference |
|------------------|-----------------------------------------------|------------------------------------|
| `first_weighted` | other tokens, residual weighted 1/max(‖x_pre‖, ‖x_post‖) (default) | x + b, b = mean(X_post − X_pre) |
| `first`          | other tokens, unweighted                      | x + b                              |
| `plain`          | every token (the paper)                       | x·W                                |
| `weighted`       | every token, weighted as above                | x·W                                |

One pass accumulates all four variants' sums, split by token group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.solver import solve
from .base import GapFit, GapTaps, NoFold, RecoveryConfig, register, residual_identity

@dataclass
class TokenCounts:
    regular: int = 0
    first: int = 0
    massive_first: int = 0
    massive_other: int = 0


class GhostStatistics:
    """Float64 accumulators for one gap, split by token group so every fit variant comes from one pass.

    `plain_*` are unweighted, `weighted_*` weigh each token's residual by 1/max(‖x_pre‖, ‖x_post‖);
    `rest` excludes first-position tokens, `first` holds only them.
    """

    GROUPS = ("plain_rest", "plain_first", "weighted_rest", "weighted_first")
    # A token whose x_post norm exceeds this multiple of the median is counted as a massive activation
    # (reported only: it tells the user whether sinks other than the first token exist).
    MASSIVE_RATIO = 20.0

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        c = hidden_size
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.xtx = {g: z(c, c) for g in self.GROUPS}
        self.xtd = {g: z(c, c) for g in self.GROUPS}
        self.first_delta_sum = z(c)
        self.counts = TokenCounts()

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        x_pre, x_post, first = taps.x_pre, taps.x_post, taps.first
        keep = taps.mask.bool()
        x = x_pre[keep].to(torch.float64)
        d = x_post[keep].to(torch.float64) - x
        is_first = first[keep]
        post_norm = (x + d).norm(dim=-1)
        weight = 1.0 / torch.maximum(x.norm(dim=-1), post_norm).clamp_min(1e-12)
        for group, rows in (("rest", ~is_first), ("first", is_first)):
            if not rows.any():
                continue
            xs, ds, ws = x[rows], d[rows], weight[rows].unsqueeze(1)
            self.xtx[f"plain_{group}"] += xs.T @ xs
            self.xtd[f"plain_{group}"] += xs.T @ ds
            xw, dw = xs * ws, ds * ws
            self.xtx[f"weighted_{group}"] += xw.T @ xw
            self.xtd[f"weighted_{group}"] += xw.T @ dw
        self.first_delta_sum += d[is_first].sum(0)
        massive = post_norm > self.MASSIVE_RATIO * post_norm.median()
        self.counts.regular += int((~is_first).sum())
        self.counts.first += int(is_first.sum())
        self.counts.massive_first += int((massive & is_first).sum())
        self.counts.massive_other += int((massive & ~is_first).sum())

    def normal_equations(self, weighted: bool, include_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "weighted" if weighted else "plain"
        xtx, xtd = self.xtx[f"{kind}_rest"].clone(), self.xtd[f"{kind}_rest"].clone()
        if include_first:
            xtx += self.xtx[f"{kind}_first"]
            xtd += self.xtd[f"{kind}_first"]
        return xtx, xtd

    def first_shift(self) -> torch.Tensor:
        return self.first_delta_sum / max(self.counts.first, 1)

    def state_dict(self) -> dict:
        return {
            "xtx": self.xtx,
            "xtd": self.xtd,
            "first_delta_sum": self.first_delta_sum,
            "counts": vars(self.counts).copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.xtx = {k: v.to(torch.float64) for k, v in state["xtx"].items()}
        self.xtd = {k: v.to(torch.float64) for k, v in state["xtd"].items()}
        self.first_delta_sum = state["first_delta_sum"].to(torch.float64)
        self.counts = TokenCounts(**state["counts"])


class Ghost(NoFold):
    name = "ghost"

    def collector(self, hidden_size: int, device: torch.device | str) -> GhostStatistics:
        return GhostStatistics(hidden_size, device=device)

    def validate(self, cfg: RecoveryConfig) -> None:
        pass  # `fit`, `solver` and `ridge` are checked with every recovery entry (`validate_recovery`)

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        return GapFit(operator=fit_ghost(cfg, gap, stats))

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return residual_identity(cfg, hidden_size)


def fit_ghost(cfg: RecoveryConfig, gap: Gap, stats: GhostStatistics) -> GhostOperator:
    """Solve one gap's operator for the fit variant `cfg.fit` (float64 solve, stored in float32)."""
    separate_first = cfg.fit in ("first", "first_weighted")
    weighted = cfg.fit in ("weighted", "first_weighted")
    xtx, xtd = stats.normal_equations(weighted=weighted, include_first=not separate_first)
    tokens = stats.counts.regular + (0 if separate_first else stats.counts.first)
    if tokens == 0:
        raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
    delta = solve(xtx, xtd, cfg.solver, cfg.ridge, tokens=tokens, what=f"{cfg.name} (ghost, fit {cfg.fit}) gap {gap.key}")
    op = GhostOperator(xtx.shape[0], separate_first=separate_first)
    op.load_solution(delta, stats.first_shift() if separate_first else None)
    return op


register(Ghost())
