"""Recovery methods behind one interface: each turns its calibration statistics into a view.

| method        | what is inserted / changed                                         | statistics            |
|---------------|--------------------------------------------------------------------|-----------------------|
| `none`        | nothing (the pruned model, fine-tunable under its own name)        | –                     |
| `ghost`       | W = I + M per gap, closed-form least squares (Ghosted Layers)      | `GhostStatistics`     |
| `linearpatch` | W = H·diag(s)·Hᵀ per gap (LinearPatch); `variant: diag` uses H = I | `LinearPatchStatistics` |
| `replaceme`   | T on the MLP output of the block before the gap, fused into its down_proj (ReplaceMe) | `ReplaceMeStatistics` |
| `magnitude`   | one scalar per gap (Prune&Comp), folded into the output projections after the gap | `MagnitudeStatistics` |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .operator import GhostOperator
from .plan import Gap
from .solver import SolverName, solve

MethodName = Literal["none", "ghost", "linearpatch", "replaceme", "magnitude"]
METHODS: tuple[str, ...] = ("none", "ghost", "linearpatch", "replaceme", "magnitude")

# How first-position (massive-activation) tokens enter the ghost fit; see README "Massive activations".
#   first_weighted  W fitted on all other tokens, each residual weighted by 1/max(‖x_pre‖, ‖x_post‖);
#                   first-position tokens get their own mean shift (default: best at 7 and 11 removed
#                   layers of SmolLM2, see README)
#   first           as first_weighted, unweighted
#   plain           the paper's fit: every token, one W for all
#   weighted        every token, weighted as above, one W for all
FitName = Literal["first", "plain", "weighted", "first_weighted"]
FITS: tuple[str, ...] = ("first", "plain", "weighted", "first_weighted")


@dataclass
class RecoveryConfig:
    """One recovery method, evaluated (and later fine-tuned) beside the others.

    Args:
        name: label in results; also the view name (`dense` and `pruned` are reserved).
        method: ``none``, ``ghost``, ``linearpatch``, ``replaceme`` or ``magnitude``.
        fit: (ghost) treatment of first-position tokens, see `FITS`.
        solver: (ghost, replaceme) ``ridge`` (regularised normal equations) or ``lstsq`` (minimum norm).
        ridge: relative regulariser; ε = ridge · tr(XᵀX)/C.
        variant: (linearpatch) ``rotate`` (Hadamard) or ``diag`` (per-channel scaling only).
        order: with several gaps, ``sequential`` fits each gap on the activations the repaired student
            really feeds it (earlier gaps already repaired); ``independent`` fits every gap on the dense
            model's activations.
    """

    name: str = "ghost"
    method: MethodName = "ghost"
    fit: FitName = "first_weighted"
    solver: SolverName = "ridge"
    ridge: float = 1e-4
    variant: Literal["rotate", "diag"] = "rotate"
    order: Literal["sequential", "independent"] = "sequential"


def validate_recovery(configs: list[RecoveryConfig]) -> None:
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"recovery names must be unique; repeated: {dupes}")
    for c in configs:
        if not c.name or not c.name.replace("-", "_").isidentifier():
            raise ValueError(f"recovery name {c.name!r} must be letters, digits, '_' or '-' (it names a view)")
        if c.name in ("dense", "pruned"):
            raise ValueError(f"recovery name {c.name!r} is reserved for the baselines; pick another")
        checks = (
            ("method", c.method, METHODS),
            ("fit", c.fit, FITS),
            ("solver", c.solver, ("ridge", "lstsq")),
            ("variant", c.variant, ("rotate", "diag")),
            ("order", c.order, ("sequential", "independent")),
        )
        for field, value, valid in checks:
            if value not in valid:
                raise ValueError(f"recovery {c.name!r}: {field} {value!r} is not known; choose one of {valid}")
        if not c.ridge >= 0:
            raise ValueError(f"recovery {c.name!r}: ridge must be >= 0, got {c.ridge}")


@dataclass
class GapFit:
    """What one method puts at one gap."""

    operator: GhostOperator | None = None
    mlp_map: GhostOperator | None = None


def fit_gap(cfg: RecoveryConfig, gap: Gap, stats, hidden_size: int) -> GapFit:
    """Solve one gap for one method from that method's collector (float64), stored in float32."""
    if cfg.method == "none":
        return GapFit()
    if cfg.method == "ghost":
        return GapFit(operator=fit_ghost(cfg, gap, stats))
    if cfg.method == "linearpatch":
        return GapFit(operator=fit_linearpatch(cfg, stats, hidden_size))
    if cfg.method == "magnitude":
        return GapFit(operator=fit_magnitude(stats, hidden_size))
    if cfg.method == "replaceme":
        return GapFit(mlp_map=fit_replaceme(cfg, gap, stats))
    raise ValueError(f"recovery {cfg.name!r}: method {cfg.method!r} is not known; choose one of {METHODS}")


def identity_fit(cfg: RecoveryConfig, hidden_size: int) -> GapFit:
    """A not-yet-fitted gap in a sequential fit: the method's map, doing nothing."""
    if cfg.method == "none":
        return GapFit()
    if cfg.method == "replaceme":
        return GapFit(mlp_map=GhostOperator(hidden_size, fused=True))
    return GapFit(operator=GhostOperator(hidden_size, fused=cfg.method == "magnitude"))


def fit_ghost(cfg: RecoveryConfig, gap: Gap, stats) -> GhostOperator:
    separate_first = cfg.fit in ("first", "first_weighted")
    weighted = cfg.fit in ("weighted", "first_weighted")
    xtx, xtd = stats.normal_equations(weighted=weighted, include_first=not separate_first)
    if stats.counts.regular + (0 if separate_first else stats.counts.first) == 0:
        raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
    delta = solve(xtx, xtd, cfg.solver, cfg.ridge)
    op = GhostOperator(xtx.shape[0], separate_first=separate_first)
    op.load_solution(delta, stats.first_shift() if separate_first else None)
    return op


def fit_linearpatch(cfg: RecoveryConfig, stats, hidden_size: int) -> GhostOperator:
    """W = H·diag(s)·Hᵀ, s = mean|X_post H| / mean|X_pre H| per channel (H = I for `diag`); symmetric."""
    rotate = cfg.variant == "rotate"
    if rotate:
        h = stats.hadamard()  # raises for a hidden size with no known Hadamard matrix, naming it
        scale = stats.sums["post_rot"] / stats.sums["pre_rot"].clamp_min(1e-12)
        w = (h * scale) @ h.T
    else:
        w = torch.diag(stats.sums["post"] / stats.sums["pre"].clamp_min(1e-12))
    w = 0.5 * (w + w.T)  # exact symmetry despite rounding
    op = GhostOperator(hidden_size)
    op.load_solution(w - torch.eye(hidden_size, dtype=w.dtype, device=w.device))
    return op


def fit_magnitude(stats, hidden_size: int) -> GhostOperator:
    """x ← s·x with s = mean‖X_post‖ / mean‖X_pre‖. In a pre-norm model this equals dividing the output
    projections of every later block by s (the norms cancel the scale), which is how export folds it."""
    s = stats.norm_post / stats.norm_pre.clamp_min(1e-12)
    op = GhostOperator(hidden_size, fused=True)
    op.load_solution((s - 1.0) * torch.eye(hidden_size, dtype=torch.float64, device=s.device))
    return op


def fit_replaceme(cfg: RecoveryConfig, gap: Gap, stats) -> GhostOperator:
    if gap.start == 0:
        raise ValueError(f"replaceme: gap {gap.key} starts at block 0, there is no MLP before it")
    t = solve(stats.mtm, stats.mtr, cfg.solver, cfg.ridge)
    op = GhostOperator(t.shape[0], fused=True)
    op.load_solution(t - torch.eye(t.shape[0], dtype=t.dtype, device=t.device))
    return op
