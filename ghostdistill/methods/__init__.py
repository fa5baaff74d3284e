"""Recovery methods: the interface (`base`) and one module per method, each registering itself.

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

Each method reads its own keys of `RecoveryConfig` (its `keys`, with their defaults, registered with
it); a recovery entry setting a key its method does not read is rejected (`validate_recovery`):

| method            | keys (defaults)                                                                      |
|-------------------|--------------------------------------------------------------------------------------|
| `none`            | none                                                                                 |
| `ghost`           | fit (first_weighted), bias (false), scale (none), solver (ridge), ridge (1e-4), order (sequential) |
| `ghost_symmetric` | as `ghost` but no `solver`                                                           |
| `linearpatch`     | variant (rotate), order (sequential)                                                 |
| `rotation`, `rotation_through`, `rotation_anchored` | order (sequential)                               |
| `replaceme`       | solver (ridge), ridge (1e-4), order (sequential)                                     |
| `magnitude`       | order (sequential)                                                                   |

The package's one public entry point is this module (`ghostdistill.methods`): the interface, the
configuration and the registry (`interface.py`), and what a run does with them (`config.py`). Method
modules import from `interface` only.

Adding a method: a new module that calls `register(...)` on an object implementing `Method`,
and its name in the import line below. The object's `keys` names the `RecoveryConfig` fields its fit
reads, each with its default (e.g. ``keys = {"variant": "rotate", **ORDER_KEYS}``; without `keys` it
reads `order` only); a setting no field holds yet is a new `RecoveryConfig` field defaulting to None
(unset), documented there with the methods that read it.
"""

from . import ghost, ghost_symmetric, linearpatch, magnitude, none, replaceme, rotation  # noqa: F401  (the registry)
from .config import (
    FLAT_DEFAULTS,
    FT_SUFFIX,
    RESERVED_NAMES,
    drop_flat_defaults,
    fit_gap,
    flat_settings,
    identity_fit,
    make_collectors,
    needs_mlp,
    statistics_layout,
    validate_recovery,
)
from .interface import (
    ORDER_KEYS,
    SOLVE_KEYS,
    Collector,
    GapFit,
    GapTaps,
    Method,
    NoFold,
    RecoveryConfig,
    get_method,
    method_keys,
    register,
    registered,
    residual_identity,
    setting_keys,
    ships_stock,
    unregister,
)

__all__ = [
    "Collector",
    "FLAT_DEFAULTS",
    "FT_SUFFIX",
    "GapFit",
    "GapTaps",
    "Method",
    "NoFold",
    "ORDER_KEYS",
    "RESERVED_NAMES",
    "RecoveryConfig",
    "SOLVE_KEYS",
    "drop_flat_defaults",
    "fit_gap",
    "flat_settings",
    "get_method",
    "identity_fit",
    "make_collectors",
    "method_keys",
    "needs_mlp",
    "register",
    "registered",
    "residual_identity",
    "setting_keys",
    "ships_stock",
    "statistics_layout",
    "unregister",
    "validate_recovery",
]
