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

from .ghost import Ghost, GhostSymmetricConfig
from .interface import register


class GhostSymmetric(Ghost):
    name = "ghost_symmetric"
    config = GhostSymmetricConfig
    symmetric = True
    card = "the best symmetric W = I + M (M = Mᵀ) at each gap, in closed form (the paper's control for ghost)"


register(GhostSymmetric())
