"""Recovery methods: how each gap's operator is fitted from the calibration statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .calibration import GapStatistics
from .operator import GhostOperator
from .plan import Gap
from .solver import SolverName, solve

# How first-position (massive-activation) tokens enter the fit; see README "Massive activations".
#   first           W fitted on all other tokens; first-position tokens get their own mean shift (default)
#   plain           the paper's fit: every token, one W for all
#   weighted        every token, residuals weighted by 1/max(‖x_pre‖, ‖x_post‖), one W for all
#   first_weighted  "first", with the remaining tokens weighted as in "weighted"
FitName = Literal["first", "plain", "weighted", "first_weighted"]
FITS: tuple[str, ...] = ("first", "plain", "weighted", "first_weighted")


@dataclass
class RecoveryConfig:
    """One recovery method evaluated (and later fine-tuned) beside the others.

    Args:
        name: label in results; also the view name (`dense` and `pruned` are reserved).
        method: ``ghost`` (closed-form linear operator per gap).
        fit: treatment of first-position tokens, see `FITS`.
        solver: ``ridge`` (regularised normal equations) or ``lstsq`` (minimum-norm solution).
        ridge: relative regulariser; ε = ridge · tr(XᵀX)/C.
    """

    name: str = "ghost"
    method: Literal["ghost"] = "ghost"
    fit: FitName = "first"
    solver: SolverName = "ridge"
    ridge: float = 1e-4


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
        if c.method != "ghost":
            raise ValueError(f"recovery {c.name!r}: method {c.method!r} is not known; choose 'ghost'")
        if c.fit not in FITS:
            raise ValueError(f"recovery {c.name!r}: fit {c.fit!r} is not known; choose one of {FITS}")
        if c.solver not in ("ridge", "lstsq"):
            raise ValueError(f"recovery {c.name!r}: solver {c.solver!r} is not known; choose 'ridge' or 'lstsq'")
        if not c.ridge >= 0:
            raise ValueError(f"recovery {c.name!r}: ridge must be >= 0, got {c.ridge}")


def fit_ghost(cfg: RecoveryConfig, gap: Gap, stats: GapStatistics) -> GhostOperator:
    """Solve one gap's operator in float64 and store it in float32."""
    separate_first = cfg.fit in ("first", "first_weighted")
    weighted = cfg.fit in ("weighted", "first_weighted")
    xtx, xtd = stats.normal_equations(weighted=weighted, include_first=not separate_first)
    if stats.counts.regular + (0 if separate_first else stats.counts.first) == 0:
        raise ValueError(f"gap {gap.key}: no calibration tokens to fit on")
    delta = solve(xtx, xtd, cfg.solver, cfg.ridge)
    op = GhostOperator(xtx.shape[0], separate_first=separate_first)
    op.load_solution(delta, stats.first_shift() if separate_first else None)
    return op
