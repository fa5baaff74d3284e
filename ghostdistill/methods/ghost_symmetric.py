"""The best symmetric operator: W = I + M with M = Mᵀ, in closed form (the paper's control).

LinearPatch's W = H·diag(s)·Hᵀ and every other construction of the form Q·diag(s)·Qᵀ is symmetric. The
Ghosted Layers claim is that the least-squares optimum has a substantial antisymmetric part that such
constructions cannot reach. This method fits the best symmetric W on exactly the statistics, token
groups, weighting, ridge and first-position map of `ghost` (`fit`, `bias`, `scale` mean the same), so
the two views differ only by the constraint and their gap in alignment error and perplexity is what
symmetry costs. The solve is the Lyapunov equation of `core.solver.solve_symmetric`; `solver` is not
read, and so rejected (the ridge applies, 0 gives the minimum-norm symmetric solution).
"""

from __future__ import annotations

from ..core.plan import Gap
from .ghost import GHOST_KEYS, GhostCollectorMixin, GhostStatistics, fit_ghost
from .interface import GapFit, NoFold, RecoveryConfig, register, residual_identity


class GhostSymmetric(GhostCollectorMixin, NoFold):
    name = "ghost_symmetric"
    keys = {k: v for k, v in GHOST_KEYS.items() if k != "solver"}

    def validate(self, cfg: RecoveryConfig) -> None:
        pass  # its `keys` are checked with every recovery entry (`validate_recovery`)

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: GhostStatistics, hidden_size: int) -> GapFit:
        return GapFit(operator=fit_ghost(cfg, gap, stats, symmetric=True))

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return residual_identity(cfg, hidden_size)


register(GhostSymmetric())
