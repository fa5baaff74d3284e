"""The interface every recovery method implements, its configuration, and the registry.

A method turns what one calibration pass shows of a gap into something that repairs that gap:

1. `collector(hidden_size, device)` makes its statistics collector for one gap (fixed-size float64
   sums, fed `GapTaps` batch by batch, saved and restored for resumable runs), or None when it reads
   nothing;
2. `fit(cfg, gap, stats, hidden_size)` solves the gap (float64) into a `GapFit`: a `GhostOperator` on
   the residual stream entering the next surviving block, and/or a map on the MLP output of the block
   before the gap;
3. `identity(cfg, hidden_size)` is the same shape doing nothing (a gap of a sequential fit not yet
   solved);
4. `fold(blocks, gap, fit)` writes the fit into existing weights where the method can (ReplaceMe,
   magnitude), so an exported model needs no extra module; `folds` says whether it can.

A method is one module in this package that defines such an object and passes it to `register`, plus
one import line in `methods/__init__.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args, get_origin, get_type_hints, runtime_checkable

import torch
from torch import nn

from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.solver import SolverName


@dataclass
class RecoveryConfig:
    """One recovery method, evaluated (and later fine-tuned) beside the others.

    Args:
        name: label in results; also the view name (`dense` and `pruned` are reserved).
        method: a registered method: ``none``, ``ghost``, ``ghost_symmetric``, ``linearpatch``,
            ``replaceme``, ``magnitude``.
        fit: (ghost, ghost_symmetric) token groups and weighting: ``first_weighted`` (default),
            ``first_normed``, ``first``, ``plain`` (the paper) or ``weighted``; see `ghostdistill.methods.ghost`.
        bias: (ghost, ghost_symmetric) fit an affine map x + x·M + c for ordinary tokens (C more parameters).
        scale: (ghost, ghost_symmetric) ``none``, or ``norm``: rescale W so that the fitted tokens' mean
            ‖x·W‖² equals their mean ‖x_post‖² (undoes least squares' shrinkage).
        solver: (ghost, replaceme) ``ridge`` (regularised normal equations) or ``lstsq`` (minimum norm).
        ridge: relative regulariser; ε = ridge · tr(XᵀX)/C.
        variant: (linearpatch) ``rotate`` (Hadamard) or ``diag`` (per-channel scaling only).
        order: with several gaps, ``sequential`` fits each gap on the activations the repaired student
            really feeds it (earlier gaps already repaired); ``independent`` fits every gap on the dense
            model's activations.
    """

    name: str = "ghost"
    method: str = "ghost"
    fit: Literal["first", "plain", "weighted", "first_weighted", "first_normed"] = "first_weighted"
    bias: bool = False
    scale: Literal["none", "norm"] = "none"
    solver: SolverName = "ridge"
    ridge: float = 1e-4
    variant: Literal["rotate", "diag"] = "rotate"
    order: Literal["sequential", "independent"] = "sequential"


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
    """What one method puts at one gap."""

    operator: GhostOperator | None = None
    mlp_map: GhostOperator | None = None


@runtime_checkable
class Collector(Protocol):
    """Per-gap statistics. `needs_mlp` (optional attribute, default False) asks for `GapTaps.mlp_out`."""

    def update(self, taps: GapTaps) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Method(Protocol):
    """A recovery method; see the module docstring for what each member does."""

    name: str
    folds: bool

    def collector(self, hidden_size: int, device: torch.device | str) -> Collector | None: ...

    def validate(self, cfg: RecoveryConfig) -> None: ...

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit: ...

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit: ...

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None: ...


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make `method` available as `recovery[].method: <method.name>`; returns it (usable as a decorator
    on an instance-making class call)."""
    if not isinstance(method, Method):
        raise TypeError(f"{method!r} does not implement ghostdistill.methods.Method")
    if not method.name or not method.name.isidentifier():
        raise ValueError(f"method name {method.name!r} must be a Python identifier")
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


def fit_gap(cfg: RecoveryConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit:
    """Solve one gap for one recovery entry with its registered method."""
    return get_method(cfg.method).fit(cfg, gap, stats, hidden_size)


def identity_fit(cfg: RecoveryConfig, hidden_size: int) -> GapFit:
    """The method's map at a gap, doing nothing (a gap of a sequential fit not yet solved)."""
    return get_method(cfg.method).identity(cfg, hidden_size)


def make_collectors(methods: set[str], hidden_size: int, device: torch.device | str) -> dict[str, Collector]:
    """One collector per method that reads statistics, keyed by method name (shared by every recovery
    entry of that method: one pass, every method's statistics)."""
    out = {}
    for name in sorted(methods):
        collector = get_method(name).collector(hidden_size, device)
        if collector is not None:
            out[name] = collector
    return out


def needs_mlp(collectors: dict[str, Collector]) -> bool:
    return any(getattr(c, "needs_mlp", False) for c in collectors.values())


RESERVED_NAMES = ("dense", "pruned")


def validate_recovery(configs: list[RecoveryConfig]) -> None:
    """Names unique and usable as view names; every method registered and its own settings valid."""
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"recovery names must be unique; repeated: {dupes}")
    for c in configs:
        if not c.name or not c.name.replace("-", "_").isidentifier():
            raise ValueError(f"recovery name {c.name!r} must be letters, digits, '_' or '-' (it names a view)")
        if c.name in RESERVED_NAMES:
            raise ValueError(f"recovery name {c.name!r} is reserved for the baselines; pick another")
        try:
            method = get_method(c.method)
        except ValueError as err:
            raise ValueError(f"recovery {c.name!r}: {err}") from None
        # Every Literal-typed setting, whichever method reads it: a typo is an error, not silently ignored.
        for field, hint in get_type_hints(RecoveryConfig).items():
            valid = get_args(hint) if get_origin(hint) is Literal else None
            if valid and getattr(c, field) not in valid:
                raise ValueError(
                    f"recovery {c.name!r}: {field} {getattr(c, field)!r} is not known; choose one of {valid}"
                )
        if not c.ridge >= 0:
            raise ValueError(f"recovery {c.name!r}: ridge must be >= 0, got {c.ridge}")
        method.validate(c)


class NoFold:
    """Mixin for methods whose maps stay as inserted modules."""

    folds = False

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        raise NotImplementedError(f"{type(self).__name__} inserts an operator; it cannot be folded into weights")


def residual_identity(cfg: RecoveryConfig, hidden_size: int, *, fused: bool = False) -> GapFit:
    """A do-nothing operator on the residual stream at the gap."""
    return GapFit(operator=GhostOperator(hidden_size, fused=fused))
