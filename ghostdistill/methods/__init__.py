"""Recovery methods: the interface (`base`) and one module per method, each registering itself.

| method        | what is inserted / changed                                                  | module          |
|---------------|-----------------------------------------------------------------------------|-----------------|
| `none`        | nothing (the pruned model, fine-tunable under its own name)                 | `none.py`       |
| `ghost`       | W = I + M per gap, closed-form least squares (Ghosted Layers)               | `ghost.py`      |
| `ghost_symmetric` | the best symmetric W = I + M (M = Mᵀ), same statistics and options as `ghost` | `ghost_symmetric.py` |
| `linearpatch` | W = H·diag(s)·Hᵀ per gap (LinearPatch); `variant: diag` uses H = I           | `linearpatch.py`|
| `replaceme`   | T on the MLP output of the block before the gap, folded into its down_proj  | `replaceme.py`  |
| `magnitude`   | one scalar per gap (Prune&Comp), folded into the later blocks' output projections | `magnitude.py` |

Adding a method: a new module that calls `register(...)` on an object implementing `base.Method`,
and its name in the import line below.
"""

from . import ghost, ghost_symmetric, linearpatch, magnitude, none, replaceme  # noqa: F401  (the registry)
from .base import (
    Collector,
    GapFit,
    GapTaps,
    Method,
    RecoveryConfig,
    fit_gap,
    get_method,
    identity_fit,
    make_collectors,
    needs_mlp,
    register,
    registered,
    unregister,
    validate_recovery,
)

__all__ = [
    "Collector",
    "GapFit",
    "GapTaps",
    "Method",
    "RecoveryConfig",
    "fit_gap",
    "get_method",
    "identity_fit",
    "make_collectors",
    "needs_mlp",
    "register",
    "registered",
    "unregister",
    "validate_recovery",
]
