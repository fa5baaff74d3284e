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
5. `student_operator(operator)` (optional): what a fine-tuned student trains in place of a fitted operator,
   for a method whose fold needs the operator's form (rotation: a scaled rotation; magnitude: a scale);
   without it a student trains the operator's W = I + M freely;
6. `keys`: the `RecoveryConfig` keys it reads, with their defaults. Its own configuration is those keys
   and nothing else: a config is resolved to their defaults when made, and `validate_recovery` rejects a
   key the method does not read, naming the key and the method's keys.

A method is one module in this package that defines such an object and passes it to `register`, plus
one import line in `methods/__init__.py`.

This module is the bottom of the package: the protocols, `RecoveryConfig` and the registry live together
because a config resolves its defaults from the registered method's `keys` and the protocols take a
config. `methods.config` (flat settings, validation, collectors) builds on it; `ghostdistill.methods` is
the one public entry point and re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.solver import SolverName


@dataclass
class GapTaps:
    """What one batch shows of one gap: the residual stream entering the gap (`x_pre`) and the one the
    next surviving block should see (`x_post`), the padding mask, the first-position mask, and the MLP
    output of the last block before the gap (only captured when a collector asks, `needs_mlp`)."""

    x_pre: torch.Tensor
    x_post: torch.Tensor
    mask: torch.Tensor
    first: torch.Tensor
    mlp_out: torch.Tensor | None = None


@dataclass
class GapFit:
    """What one method puts at one gap; `note`: what the run must be told about this fit (an assumption of the
    method that did not hold, and what it did instead), in its log and results."""

    operator: GhostOperator | None = None
    mlp_map: GhostOperator | None = None
    note: str | None = None


@runtime_checkable
class Collector(Protocol):
    """Per-gap statistics. `needs_mlp` (optional attribute, default False) asks for `GapTaps.mlp_out`."""

    def update(self, taps: GapTaps) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Method(Protocol):
    """A recovery method; see the module docstring for what each member does.

    Besides these members a method declares `keys`: the `RecoveryConfig` keys its fit reads, each with
    its default (e.g. ``{"variant": "rotate", "order": "sequential"}``); every other key is rejected for
    it. Without `keys` a method reads `order` only. (`keys` is not a Protocol member, so methods written
    before it still register.)
    """

    name: str
    folds: bool

    def collector(self, hidden_size: int, device: torch.device | str) -> Collector | None: ...

    def validate(self, cfg: RecoveryConfig) -> None: ...

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit: ...

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit: ...

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None: ...


class NoFold:
    """Mixin for methods whose maps stay as inserted modules."""

    folds = False

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        raise NotImplementedError(f"{type(self).__name__} inserts an operator; it cannot be folded into weights")


def residual_identity(cfg: RecoveryConfig, hidden_size: int, *, fused: bool = False) -> GapFit:
    """A do-nothing operator on the residual stream at the gap."""
    return GapFit(operator=GhostOperator(hidden_size, fused=fused))


# The keys of `RecoveryConfig` beyond `name` and `method`: each method reads some of them (its `keys`).
ORDER_KEYS: dict[str, Any] = {"order": "sequential"}
SOLVE_KEYS: dict[str, Any] = {"solver": "ridge", "ridge": 1e-4}


@dataclass
class RecoveryConfig:
    """One recovery method, evaluated (and later fine-tuned) beside the others.

    Every key but `name` and `method` belongs to the methods that read it (in parentheses below; each
    method lists them, with their defaults, in its `keys`). Unset (None) means the method's default, filled
    in when the config is made (`resolved`); a key the chosen method does not read stays None, and setting
    it is an error (`validate_recovery`) that names the key and the method's keys.

    Args:
        name: label in results; also the view name (`dense`, `pruned` and names ending in ``_ft``, the
            fine-tuned views, are reserved).
        method: a registered method: ``none`` (reads no other key), ``ghost``, ``ghost_symmetric``,
            ``linearpatch``, ``replaceme``, ``magnitude``, ``rotation``, ``rotation_through``,
            ``rotation_anchored``.
        fit: (ghost, ghost_symmetric) token groups and weighting: ``first_weighted`` (default),
            ``first_normed``, ``first``, ``plain`` (the paper) or ``weighted``; see `ghostdistill.methods.ghost`.
        bias: (ghost, ghost_symmetric) fit an affine map x + x·M + c for ordinary tokens (C more
            parameters); default false.
        scale: (ghost, ghost_symmetric) ``none`` (default), or ``norm``: rescale W so that the fitted
            tokens' mean ‖x·W‖² equals their mean ‖x_post‖² (undoes least squares' shrinkage).
        solver: (ghost, replaceme) ``ridge`` (regularised normal equations; default) or ``lstsq``
            (minimum norm). ``ghost_symmetric`` always solves its Lyapunov equation and does not read it.
        ridge: (ghost, ghost_symmetric, replaceme) relative regulariser; ε = ridge · tr(XᵀX)/C; default 1e-4.
        variant: (linearpatch) ``rotate`` (Hadamard; default) or ``diag`` (per-channel scaling only).
        order: (every method with statistics: all but ``none``) with several gaps, ``sequential``
            (default) fits each gap on the activations the repaired student really feeds it (earlier gaps
            already repaired); ``independent`` fits every gap on the dense model's activations.
    """

    name: str = "ghost"
    method: str = "ghost"
    fit: Literal["first", "plain", "weighted", "first_weighted", "first_normed"] | None = None
    bias: bool | None = None
    scale: Literal["none", "norm"] | None = None
    solver: SolverName | None = None
    ridge: float | None = None
    variant: Literal["rotate", "diag"] | None = None
    order: Literal["sequential", "independent"] | None = None

    def __post_init__(self) -> None:
        _fill_defaults(self)

    def resolved(self) -> RecoveryConfig:
        """A copy with every key the method reads set: its default where unset. Configs are resolved
        when made; this is for one whose `method` changed since (or was registered after it was made)."""
        out = replace(self)
        _fill_defaults(out)
        return out

    def settings(self) -> dict[str, Any]:
        """`name`, `method` and the resolved value of every key the method reads (what its fit sees)."""
        cfg = self.resolved()
        keys = method_keys(get_method(self.method))
        return {"name": cfg.name, "method": cfg.method, **{k: getattr(cfg, k) for k in keys}}


def setting_keys() -> tuple[str, ...]:
    """The method-specific keys of `RecoveryConfig`, in field order."""
    return tuple(f.name for f in fields(RecoveryConfig) if f.name not in ("name", "method"))


def method_keys(method: Method) -> dict[str, Any]:
    """The `RecoveryConfig` keys `method` reads, with their defaults, in field order. A method that
    declares no `keys` reads `order` only (every method with statistics can be fitted sequentially)."""
    keys = getattr(method, "keys", None)
    keys = dict(ORDER_KEYS) if keys is None else keys
    return {k: keys[k] for k in setting_keys() if k in keys}


def _fill_defaults(cfg: RecoveryConfig) -> None:
    method = _REGISTRY.get(cfg.method)
    if method is None:
        return  # `validate_recovery` names the unknown method
    for key, default in method_keys(method).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, default)


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make `method` available as `recovery[].method: <method.name>`; returns it (usable as a decorator
    on an instance-making class call)."""
    if not isinstance(method, Method):
        raise TypeError(f"{method!r} does not implement ghostdistill.methods.Method")
    if not method.name or not method.name.isidentifier():
        raise ValueError(f"method name {method.name!r} must be a Python identifier")
    keys = getattr(method, "keys", None)
    if keys is not None:
        unknown = [k for k in keys if k not in setting_keys()]
        if unknown:
            raise ValueError(
                f"method {method.name!r}: keys {unknown} are not RecoveryConfig keys; choose from {list(setting_keys())}"
            )
        unset = [k for k, v in keys.items() if v is None]
        if unset:
            raise ValueError(f"method {method.name!r}: keys {unset} need a default (None means 'unset')")
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"recovery method {name!r} is not known; choose one of {list(_REGISTRY)}")
    return _REGISTRY[name]


# What a view that is not a method's names as its method: the dense model and the pruned one (`core.views`).
_PLAIN_VIEWS = ("dense", "pruned")


def ships_stock(method: str | None) -> bool:
    """Whether a training-free view of `method` exports as the model's own architecture, which every serving
    stack runs (no operator module, no remote code): the dense and pruned models (`None`, ``none``,
    ``dense``, ``pruned``) and the methods that fold into the weights. A student of such a method stays
    stock whatever it trains: LoRA, norms, the tail and blocks are merged at export, and operators train
    within what folds (the method's `student_operator`: scaled rotations, a residual scale)."""
    if method is None or method in _PLAIN_VIEWS:
        return True
    spec = get_method(method)
    return bool(spec.folds) or spec.name == "none"
