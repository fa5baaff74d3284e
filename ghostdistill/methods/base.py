"""The interface every recovery method implements, its configuration, and the registry.

A method turns what one calibration pass shows of a gap into something that repairs that gap:

1. `collector(hidden_size, device)` makes its statistics collector for one gap (fixed-size float64
   sums, fed `GapTaps` batch by batch, saved and restored for resumable runs), or None when it reads
   nothing; a method may also declare `all_parts` and `parts(cfgs)` (the parts of its statistics the
   fits of `cfgs` read) and take `collector(..., parts=...)`, so a run holds only what it fits
   (`make_collectors(..., recovery=...)`);
2. `fit(cfg, gap, stats, hidden_size)` solves the gap (float64) into a `GapFit`: a `GhostOperator` on
   the residual stream entering the next surviving block, and/or a map on the MLP output of the block
   before the gap;
3. `identity(cfg, hidden_size)` is the same shape doing nothing (a gap of a sequential fit not yet
   solved);
4. `fold(blocks, gap, fit)` writes the fit into existing weights where the method can (ReplaceMe,
   magnitude), so an exported model needs no extra module; `folds` says whether it can;
5. `keys`: the `RecoveryConfig` keys it reads, with their defaults. Its own configuration is those keys
   and nothing else: a config is resolved to their defaults when made, and `validate_recovery` rejects a
   key the method does not read, naming the key and the method's keys.

A method is one module in this package that defines such an object and passes it to `register`, plus
one import line in `methods/__init__.py`.
"""

from .config import (  # noqa: F401  (the public names of `methods.base`)
    FLAT_DEFAULTS,
    FT_SUFFIX,
    ORDER_KEYS,
    RESERVED_NAMES,
    SOLVE_KEYS,
    RecoveryConfig,
    drop_flat_defaults,
    fit_gap,
    flat_settings,
    get_method,
    identity_fit,
    make_collectors,
    method_keys,
    needs_mlp,
    register,
    registered,
    setting_keys,
    statistics_layout,
    unregister,
    validate_recovery,
)
from .interface import Collector, GapFit, GapTaps, Method, NoFold, residual_identity  # noqa: F401
