"""Recovery methods: the interface (`interface.py`) and one module per method, each registering itself.

| method        | what is inserted / changed                                                  | module          |
|---------------|-----------------------------------------------------------------------------|-----------------|
| `none`        | nothing (the pruned model, fine-tunable under its own name)                 | `none.py`       |
| `ghost`       | W = I + M per gap, closed-form least squares (Ghosted Layers)               | `ghost.py`      |
| `ghost_symmetric` | the best symmetric W = I + M (M = Mᵀ), same statistics and options as `ghost` | `ghost_symmetric.py` |
| `linearpatch` | W = H·diag(s)·Hᵀ per gap (LinearPatch); `variant: diag` uses H = I           | `linearpatch.py`|
| `replaceme`   | T on the MLP output of the block before the gap, folded into its down_proj  | `replaceme.py`  |
| `magnitude`   | one scalar per gap (Prune&Comp), folded into the later blocks' output projections | `magnitude.py` |
| `rotation`    | W = c·Q per gap (weighted Procrustes), first-position tokens shifted apart    | `rotation.py`   |
| `rotation_through` | W = c·Q for every token; folded into the weights at export (plain architecture) | `rotation.py` |
| `rotation_anchored` | as `rotation_through`, Q fixing the first position's massive direction (u·Q = u) | `rotation.py` |

Each method's config class (`Method.config`, a `MethodConfig` dataclass) holds the keys its fit reads, with
their types, defaults and docs; a recovery entry setting a key its method does not read is rejected:

| method            | config class            | keys (defaults)                                                   |
|-------------------|-------------------------|-------------------------------------------------------------------|
| `none`            | `MethodConfig`          | none                                                              |
| `ghost`           | `GhostConfig`           | fit (first_weighted), bias (false), scale (none), solver (ridge), ridge (1e-4), order (sequential) |
| `ghost_symmetric` | `GhostSymmetricConfig`  | as `ghost` but no `solver`                                        |
| `linearpatch`     | `LinearPatchConfig`     | variant (rotate), order (sequential)                              |
| `replaceme`       | `Solved`                | solver (ridge), ridge (1e-4), order (sequential)                  |
| `magnitude`, `rotation`, `rotation_through`, `rotation_anchored` | `Ordered` | order (sequential)      |

Not every method can be right on every model family: `family.py` (the table method × family is in
docs/reliability.md).

The package's one public entry point is this module: the interface, the configuration and the registry
(`interface.py`), and what a run does with them (`config.py`). Method modules import from `interface` and from
each other's shared parts (`ghost_symmetric` and the rotations build on `ghost`; the rotations fold with
`magnitude`'s scale and `replaceme`'s output map).

Adding a method: a module (here, or your own) subclassing `Method` and `MethodConfig` and calling `register(...)`
(`interface.py`; docs/development.md, "How to add a method"); a shipped one is also named in the import below.
"""

from . import ghost, ghost_symmetric, linearpatch, magnitude, none, replaceme, rotation  # noqa: F401  (the registry)
from .config import (
    applicable,
    check_family,
    drop_flat_defaults,
    fit_gap,
    flat_settings,
    identity_fit,
    make_collectors,
    needs_mlp,
    recovery_entry,
    statistics_layout,
    validate_recovery,
)
from .family import FamilyFacts, family_facts
from .ghost import GhostConfig, GhostSymmetricConfig
from .interface import (
    FLAT_DEFAULTS,
    Collector,
    GapFit,
    GapTaps,
    Method,
    MethodConfig,
    Ordered,
    RecoveryConfig,
    Ridge,
    Solved,
    get_method,
    method_keys,
    register,
    registered,
    setting_keys,
    ships_stock,
    unregister,
)
from .linearpatch import LinearPatchConfig

__all__ = [
    "Collector",
    "FamilyFacts",
    "FLAT_DEFAULTS",
    "GapFit",
    "GapTaps",
    "GhostConfig",
    "GhostSymmetricConfig",
    "LinearPatchConfig",
    "Method",
    "MethodConfig",
    "Ordered",
    "RecoveryConfig",
    "Ridge",
    "Solved",
    "applicable",
    "check_family",
    "drop_flat_defaults",
    "family_facts",
    "fit_gap",
    "flat_settings",
    "get_method",
    "identity_fit",
    "make_collectors",
    "method_keys",
    "needs_mlp",
    "recovery_entry",
    "register",
    "registered",
    "setting_keys",
    "ships_stock",
    "statistics_layout",
    "unregister",
    "validate_recovery",
]
