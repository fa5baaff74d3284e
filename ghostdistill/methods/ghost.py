"""Ghosted Layers: one closed-form linear operator per gap, W = I + M, on the residual stream.

Per gap, M = argmin ‖X_pre M − (X_post − X_pre)‖² from float64 normal equations accumulated over the calibration
tokens (`GhostStatistics`), solved by ridge or minimum-norm least squares (`core.solver`). The operator x ← x + x·M
acts on the residual stream entering the first block after the gap.

Massive activations: the first token of every sequence carries a huge activation that the removed blocks create.
Fitting W on it bends W for every other token, so the fit variants (`fit`) treat it apart:

| fit              | W fitted on                                   | first-position tokens at inference |
|------------------|-----------------------------------------------|------------------------------------|
| `first_weighted` | other tokens, residual weighted 1/max(‖x_pre‖, ‖x_post‖) (default) | x + b, b = mean(X_post − X_pre) |
| `first_normed`   | other tokens, residual weighted 1/‖x_post‖ (the error relative to what the next block's norm reads) | x + b |
| `first`          | other tokens, unweighted                      | x + b                              |
| `plain`          | every token (the paper)                       | x·W                                |
| `weighted`       | every token, weighted 1/max(‖x_pre‖, ‖x_post‖) | x·W                               |

Two options change the objective of any fit (measured in docs/results/fit-variants.md):

- `bias: true` fits an affine map x + x·M + c. With per-token weights w, c = μ_D − μ_X·M (weighted
  means) and M solves the centred normal equations A − n·μ_Xᵀμ_X, B − n·μ_Xᵀμ_D (the ridge acts on M only).
- `scale: norm` multiplies W by s = (Σ w²‖x_post‖² / Σ w²‖x_pre·W‖²)^½: least squares shrinks the
  prediction towards the mean in every direction it cannot explain, so ‖x·W‖ falls short of ‖x_post‖;
  s restores the energy the next blocks expect (LinearPatch and Prune&Comp match magnitudes the same way).

The symmetric-constrained fit (`ghost_symmetric.py`) and the rotations read the same statistics
(`GhostStatistics`): one pass accumulates the sums of every variant the run fits, plus the weighted first
moments and Σ w²‖d‖² that the bias, the scale and the alignment error (`objective`) need.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.solver import solve, solve_symmetric
from .interface import GapFit, GapTaps, Method, Ridge, Solved, register


@dataclass
class TokenCounts:
    regular: int = 0
    first: int = 0
    massive_first: int = 0
    massive_other: int = 0


class GhostStatistics:
    """Float64 accumulators for one gap, split by token group so every fit variant comes from one pass.

    Per weighting (`plain`: 1, `weighted`: 1/max(‖x_pre‖, ‖x_post‖), `normed`: 1/‖x_post‖) and group
    (`rest`: every token but the first position, `first`: only them), with w the token's weight:
    `xtx` = Σ w² x xᵀ, `xtd` = Σ w² x dᵀ, `xsum` = Σ w² x, `dsum` = Σ w² d, `scalars` = (Σ w², Σ w²‖d‖²).

    `groups` (default: all of `GROUPS`) are the ones accumulated (`fit_groups` of the run's entries): each
    group's sums are computed as they would be with every group kept, so a fit reading only kept groups
    gets bit-identical sums. The first-position mean shift and the token counts are always kept.
    """

    WEIGHTINGS = ("plain", "weighted", "normed")
    GROUPS = tuple(f"{w}_{g}" for w in WEIGHTINGS for g in ("rest", "first"))
    # A token whose x_post norm exceeds this multiple of the median is counted as a massive activation
    # (reported only: it tells the user whether sinks other than the first token exist).
    MASSIVE_RATIO = 20.0

    def __init__(
        self, hidden_size: int, device: torch.device | str = "cpu", groups: Iterable[str] | None = None
    ) -> None:
        c = hidden_size
        wanted = set(self.GROUPS if groups is None else groups)
        unknown = sorted(wanted - set(self.GROUPS))
        if unknown or not wanted:
            raise ValueError(f"ghost statistics groups {unknown or '(none)'}: choose from {list(self.GROUPS)}")
        self.groups = tuple(g for g in self.GROUPS if g in wanted)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.xtx = {g: z(c, c) for g in self.groups}
        self.xtd = {g: z(c, c) for g in self.groups}
        self.xsum = {g: z(c) for g in self.groups}
        self.dsum = {g: z(c) for g in self.groups}
        self.scalars = {g: z(2) for g in self.groups}
        self.first_delta_sum = z(c)
        self.counts = TokenCounts()

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        keep = taps.mask.bool()
        x = taps.x_pre[keep].to(torch.float64)
        d = taps.x_post[keep].to(torch.float64) - x
        is_first = taps.first[keep]
        post_norm = (x + d).norm(dim=-1)
        kinds = {k.rsplit("_", 1)[0] for k in self.groups}
        weights = {
            "plain": lambda: torch.ones_like(post_norm),
            "weighted": lambda: 1.0 / torch.maximum(x.norm(dim=-1), post_norm).clamp_min(1e-12),
            "normed": lambda: 1.0 / post_norm.clamp_min(1e-12),
        }
        weights = {kind: make() for kind, make in weights.items() if kind in kinds}
        for group, rows in (("rest", ~is_first), ("first", is_first)):
            if not rows.any():
                continue
            for kind, weight in weights.items():
                key = f"{kind}_{group}"
                if key not in self.xtx:
                    continue
                w = weight[rows].unsqueeze(1)
                xs, ds = x[rows] * w, d[rows] * w  # exact for `plain` (w = 1)
                self.xtx[key] += xs.T @ xs
                self.xtd[key] += xs.T @ ds
                # Weighted first moments: Σ w²·x = Σ (w·x)·w.
                self.xsum[key] += (xs * w).sum(0)
                self.dsum[key] += (ds * w).sum(0)
                self.scalars[key] += torch.stack([(w * w).sum(), (ds * ds).sum()])
        self.first_delta_sum += d[is_first].sum(0)
        massive = post_norm > self.MASSIVE_RATIO * post_norm.median()
        self.counts.regular += int((~is_first).sum())
        self.counts.first += int(is_first.sum())
        self.counts.massive_first += int((massive & is_first).sum())
        self.counts.massive_other += int((massive & ~is_first).sum())

    def group_keys(self, weighting: str, include_first: bool) -> list[str]:
        if weighting not in self.WEIGHTINGS:
            raise ValueError(f"weighting {weighting!r} is not known; choose one of {self.WEIGHTINGS}")
        keys = _keys(weighting, include_first)
        if missing := [k for k in keys if k not in self.xtx]:
            raise ValueError(
                f"ghost statistics hold groups {list(self.groups)}, not {missing}: the collector was sized for "
                "other recovery entries (make it with make_collectors(..., recovery=<every entry fitted>))"
            )
        return keys

    def normal_equations(self, weighting: str, include_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ w² x xᵀ, Σ w² x dᵀ) over the chosen groups."""
        keys = self.group_keys(weighting, include_first)
        return sum(self.xtx[k] for k in keys).clone(), sum(self.xtd[k] for k in keys).clone()

    def moments(self, weighting: str, include_first: bool) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(Σ w² x, Σ w² d, Σ w², Σ w²‖d‖²) over the chosen groups."""
        keys = self.group_keys(weighting, include_first)
        scal = sum(self.scalars[k] for k in keys)
        return sum(self.xsum[k] for k in keys), sum(self.dsum[k] for k in keys), float(scal[0]), float(scal[1])

    def first_shift(self) -> torch.Tensor:
        return self.first_delta_sum / max(self.counts.first, 1)

    SUMS = ("xtx", "xtd", "xsum", "dsum", "scalars")  # the per-group sums

    def state_dict(self) -> dict:
        sums = {k: getattr(self, k) for k in self.SUMS}
        return {**sums, "first_delta_sum": self.first_delta_sum, "counts": vars(self.counts).copy()}

    def load_state_dict(self, state: dict) -> None:
        if missing := [k for k in self.SUMS if set(state.get(k, {})) != set(self.groups)]:
            raise ValueError(
                f"ghost statistics {missing} do not hold the groups of this collector ({list(self.groups)}): the "
                "state comes from an older version or from a collector sized for other recovery entries, and "
                "cannot be resumed"
            )
        for key in self.SUMS:
            setattr(self, key, {k: v.to(torch.float64) for k, v in state[key].items()})
        self.first_delta_sum = state["first_delta_sum"].to(torch.float64)
        self.counts = TokenCounts(**state["counts"])


def objective(
    stats: GhostStatistics, delta: torch.Tensor, bias: torch.Tensor | None, weighting: str, include_first: bool
) -> tuple[float, float]:
    """(Σ w²‖x·M + c − d‖², Σ w²‖d‖²) over the chosen groups, from the sums alone: what the closed form
    minimises, and the same error for M = 0 (the pruned model). Their ratio squared-rooted is the
    alignment error ‖X_pre W − X_post‖ / ‖X_post − X_pre‖."""
    xtx, xtd = stats.normal_equations(weighting, include_first)
    xsum, dsum, n, dd = stats.moments(weighting, include_first)
    err = float(torch.sum(delta * (xtx @ delta)) - 2 * torch.sum(delta * xtd)) + dd
    if bias is not None:
        err += float(2 * (xsum @ delta) @ bias - 2 * dsum @ bias) + n * float(bias @ bias)
    return max(err, 0.0), dd


@dataclass
class GhostSymmetricConfig(Ridge):
    """`ghost_symmetric`'s keys: `ghost`'s but `solver` (it always solves its Lyapunov equation).

    Args:
        fit: token groups and weighting: ``first_weighted`` (default), ``first_normed``, ``first``, ``plain``
            (the paper) or ``weighted`` (the table of `ghostdistill.methods.ghost`).
        bias: fit an affine map x + x·M + c for ordinary tokens (C more parameters); default false.
        scale: ``none`` (default), or ``norm``: rescale W so that the fitted tokens' mean ‖x·W‖² equals their
            mean ‖x_post‖² (undoes least squares' shrinkage).
    """

    fit: Literal["first", "plain", "weighted", "first_weighted", "first_normed"] = "first_weighted"
    bias: bool = False
    scale: Literal["none", "norm"] = "none"


@dataclass
class GhostConfig(Solved, GhostSymmetricConfig):
    """`ghost`'s keys: fit, bias, scale, solver, ridge, order."""


FIT_WEIGHTING = {
    "first_weighted": "weighted",
    "first_normed": "normed",
    "first": "plain",
    "plain": "plain",
    "weighted": "weighted",
}


def fit_groups(cfgs: Iterable[GhostSymmetricConfig]) -> tuple[str, ...]:
    """The `GhostStatistics` groups that fitting `cfgs` (ghost or ghost_symmetric configs) reads, in
    `GROUPS` order: the fit's weighting over the ordinary tokens, and over the first position too for the
    fits that do not map it apart (`plain`, `weighted`). `bias` and `scale` read the same groups' moments."""
    wanted = {k for cfg in cfgs for k in _keys(FIT_WEIGHTING[cfg.fit], include_first=not cfg.fit.startswith("first"))}
    return tuple(g for g in GhostStatistics.GROUPS if g in wanted)


def _keys(weighting: str, include_first: bool) -> list[str]:
    return [f"{weighting}_rest"] + ([f"{weighting}_first"] if include_first else [])


# The groups some fit reads (all but `normed_first`: `first_normed` maps the first position apart).
READ_GROUPS = fit_groups(GhostConfig(fit=f) for f in FIT_WEIGHTING)


class GhostCollectorMixin(Method):
    """`GhostStatistics` for `ghost`, `ghost_symmetric` and the rotations, sized to the `groups` its entries read."""

    all_groups = GhostStatistics.GROUPS

    def token_groups(self, stats: GhostStatistics) -> dict:
        """A gap's token counts: first positions, the others, and the massive activations after the gap."""
        return vars(stats.counts)

    def collector(
        self, hidden_size: int, device: torch.device | str, groups: Iterable[str] | None = None
    ) -> GhostStatistics:
        return GhostStatistics(hidden_size, device=device, groups=self.all_groups if groups is None else groups)

    def groups(self, cfgs: Iterable[GhostSymmetricConfig]) -> tuple[str, ...]:
        """What fitting `cfgs` reads (`fit_groups`); every group where that is `READ_GROUPS`, so a run of every
        variant keeps the layout (and the saved states) of the all-variants collector."""
        groups = fit_groups(cfgs)
        return GhostStatistics.GROUPS if groups == READ_GROUPS else groups


class Ghost(GhostCollectorMixin):
    name = "ghost"
    config = GhostConfig
    symmetric = False  # `ghost_symmetric`: M = Mᵀ
    card = (
        "ghost operators: a closed-form least-squares map W = I + M on the residual stream at each gap "
        "(first-position tokens get their own mean shift where the fit uses one)"
    )

    def fit(self, cfg: GhostConfig, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        return GapFit(operator=fit_ghost(cfg, gap, stats, symmetric=self.symmetric))


def fit_ghost(cfg: GhostSymmetricConfig, gap: Gap, stats: GhostStatistics, *, symmetric: bool = False) -> GhostOperator:
    """Solve one gap's operator for the fit variant `cfg.fit` with `cfg.bias` and `cfg.scale` (float64
    solve, stored in float32); `symmetric` constrains M = Mᵀ (`solve_symmetric`, which reads no `solver`)."""
    separate_first = cfg.fit.startswith("first")
    weighting = FIT_WEIGHTING[cfg.fit]
    include_first = not separate_first
    tokens = stats.counts.regular + (0 if separate_first else stats.counts.first)
    if tokens == 0:
        raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
    xtx, xtd = stats.normal_equations(weighting, include_first)
    xsum, dsum, n, _ = stats.moments(weighting, include_first)
    if cfg.bias:
        # Centre: the optimal c given M is μ_D − μ_X·M, which leaves the centred normal equations for M.
        mx, md = xsum / n, dsum / n
        xtx = xtx - n * torch.outer(mx, mx)
        xtd = xtd - n * torch.outer(mx, md)
    if symmetric:
        delta = solve_symmetric(xtx, xtd, cfg.ridge)
    else:
        what = f"{cfg.name} (ghost, fit {cfg.fit}) gap {gap.key}"
        delta = solve(xtx, xtd, cfg.solver, cfg.ridge, tokens=tokens, what=what)
    bias = (dsum - xsum @ delta) / n if cfg.bias else None
    if cfg.scale == "norm":
        delta, bias = _match_norm(stats, delta, bias, weighting, include_first)
    op = GhostOperator(xtx.shape[0], separate_first=separate_first, affine=cfg.bias)
    op.load_solution(delta, stats.first_shift() if separate_first else None, bias)
    return op


def _match_norm(
    stats: GhostStatistics, delta: torch.Tensor, bias: torch.Tensor | None, weighting: str, include_first: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W → s·W (and c → s·c) with s² = Σ w²‖x_post‖² / Σ w²‖x·W + c‖², from the sums."""
    xtx, xtd = stats.normal_equations(weighting, include_first)
    xsum, _, n, dd = stats.moments(weighting, include_first)
    eye = torch.eye(xtx.shape[0], dtype=delta.dtype, device=delta.device)
    w = delta + eye
    target = float(torch.trace(xtx) + 2 * torch.trace(xtd)) + dd  # Σ w²‖x + d‖²
    pred = float(torch.sum(w * (xtx @ w)))
    if bias is not None:
        pred += float(2 * (xsum @ w) @ bias) + n * float(bias @ bias)
    s = (target / pred) ** 0.5 if pred > 0 else 1.0
    return s * w - eye, (s * bias if bias is not None else None)


register(Ghost())
