"""The interface every recovery method implements, its configuration, and the registry.

A method is a `Method` subclass with its own config class, a `MethodConfig` dataclass whose fields are the
keys its fit reads (types, defaults, documented under ``Args:``), registered together by
``register(MyMethod())`` with ``MyMethod.config = MyConfig`` (peft's pattern: one config class and one model
class per method). A recovery entry of a config file (`RecoveryConfig`) stays one flat mapping,
``{name: g, method: ghost, fit: plain}``: `register` gives `RecoveryConfig` a field for every key a
registered config class declares, so the CLI parses, checks and prints every method's keys, and an entry is
turned into its method's config (`RecoveryConfig.method_config`) before a fit reads it.

What a method is, each member with a default on `Method` (a method overrides what it does differently):

1. `collector(hidden_size, device)`: its statistics for one gap (fixed-size float64 sums fed `GapTaps` batch
   by batch, saved and restored for resumable runs; by default a `statistics` class's), or None (it reads
   nothing). `all_parts` and
   `parts(cfgs)` name the parts of them the fits of `cfgs` read, for a `collector(..., parts=...)` that holds
   only those (`make_collectors(..., recovery=...)`); `needs_mlp`: its taps carry the MLP output of the block
   before the gap;
2. `fit(cfg, gap, stats, hidden_size)`: the gap solved (float64) into a `GapFit`, a `GhostOperator` on the
   residual stream entering the next surviving block and/or a map on the MLP output of the block before the
   gap; `cfg` is an instance of its `config`;
3. `identity(cfg, hidden_size)`: the same shape doing nothing (a gap of a sequential fit not yet solved);
4. `folds` and `fold(blocks, gap, fit)`: it writes the fit into existing weights (ReplaceMe, magnitude, the
   folding rotations), so an exported model needs no extra module; `folds_embedding`: the fold also turns
   the embedding (`export.fold`);
5. `ships_stock`: its training-free view exports as the model's own architecture (default: `folds`);
6. `student_operator(operator)`: what a fine-tuned student trains in place of a fitted operator (default:
   the operator, W = I + M freely; rotation: a scaled rotation, so that the student still folds);
7. `token_groups(stats)`: the token counts of a gap the report shows (first position, massive activations);
8. `card`: what the repair is, in a phrase, for the exported model card;
9. `supports(cfg, family)`: None, or why the method cannot be right on this model family (`methods.family`:
   a fold that is not exact where the fold is the method's point, a width it has no construction for); a run
   refuses such an entry before calibration (`methods.config.check_family`).

`register` refuses a taken name (`core.registry`), a config class that is not a `MethodConfig` dataclass
with a default for every key, and a key that another method declares with another type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any, Literal, Optional, Protocol, get_type_hints, runtime_checkable

import torch
from torch import nn

from ..core.operator import GhostOperator
from ..core.plan import Gap
from ..core.registry import Registry, origin
from ..core.solver import SolverName
from ..core.views import DENSE, PRUNED
from .family import FamilyFacts


@dataclass
class GapTaps:
    """What one batch shows of one gap: the residual stream entering the gap (`x_pre`) and the one the
    next surviving block should see (`x_post`), the padding mask, the first-position mask, and the MLP
    output of the last block before the gap (only captured for a method that `needs_mlp`)."""

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
    """Per-gap statistics: sums fed batch by batch, saved and restored."""

    def update(self, taps: GapTaps) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class MethodConfig:
    """A method's configuration: the keys its fit reads. A method's config class adds them as fields, each
    with a default, documented under ``Args:``; `validate` checks what their types do not say.

    Args:
        name: the recovery entry's name (what messages name).
    """

    name: str = ""

    def validate(self) -> None:
        """Raise ValueError for a bad value (types and choices are checked before, from the fields' types)."""


@dataclass
class Ordered(MethodConfig):
    """The key of every method with statistics (what a method without a config class of its own reads).

    Args:
        order: with several gaps, ``sequential`` (default) fits each gap on the activations the repaired
            student really feeds it (earlier gaps already repaired); ``independent`` fits every gap on the
            dense model's activations.
    """

    order: Literal["sequential", "independent"] = "sequential"


@dataclass
class Ridge(Ordered):
    """Args: ridge: relative regulariser of the solve; ε = ridge · tr(XᵀX)/C."""

    ridge: float = 1e-4

    def validate(self) -> None:
        if isinstance(self.ridge, bool) or not (isinstance(self.ridge, (int, float)) and self.ridge >= 0):
            raise ValueError(f"ridge must be a number >= 0, got {self.ridge!r}")


@dataclass
class Solved(Ridge):
    """Args: solver: ``ridge`` (regularised normal equations; default) or ``lstsq`` (minimum norm)."""

    solver: SolverName = "ridge"


def operator_of(w: torch.Tensor, *, fused: bool = False) -> GhostOperator:
    """The operator x ↦ W·x (stored as M = W − I), for a method whose fit is W itself."""
    op = GhostOperator(w.shape[0], fused=fused)
    op.load_solution(w - torch.eye(w.shape[0], dtype=w.dtype, device=w.device))
    return op


class Method:
    """A recovery method; the module docstring says what each member does. Subclasses set `name` and
    `config` and override what differs from these defaults."""

    name: str = ""
    config: type[MethodConfig] = Ordered
    folds: bool = False
    folds_embedding: bool = False
    needs_mlp: bool = False
    all_parts: tuple[str, ...] = ()
    card: str = ""
    statistics: type | None = None  # its collector's class, made as `statistics(hidden_size, device=device)`

    @property
    def ships_stock(self) -> bool:
        return self.folds

    def collector(self, hidden_size: int, device: torch.device | str) -> Collector | None:
        return None if self.statistics is None else self.statistics(hidden_size, device=device)

    def parts(self, cfgs: list[MethodConfig]) -> tuple[str, ...] | None:
        """The parts of the statistics the fits of `cfgs` read; None: the collector cannot be sized."""
        return None

    def fit(self, cfg: MethodConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit:
        raise NotImplementedError(f"method {self.name!r} defines no fit")

    def identity(self, cfg: MethodConfig, hidden_size: int) -> GapFit:
        return GapFit(operator=GhostOperator(hidden_size))  # a do-nothing operator on the residual stream

    def fold(self, blocks: list[nn.Module], gap: Gap, fit: GapFit) -> None:
        raise NotImplementedError(f"{type(self).__name__} inserts an operator; it cannot be folded into weights")

    def student_operator(self, operator: GhostOperator) -> nn.Module:
        return operator

    def token_groups(self, stats: Collector | None) -> dict | None:
        return None

    def supports(self, cfg: MethodConfig, family: FamilyFacts) -> str | None:
        return None  # what every block layout allows: an operator view, or nothing at all


# The defaults of the flat config, before each method read only its own keys: every entry carried every
# key. Run folders written then hold them all in their config.yaml, and digests were made of them
# (`methods.config.flat_settings`); `RecoveryConfig` lists these keys first, in this order.
FLAT_DEFAULTS: dict[str, Any] = {
    "fit": "first_weighted",
    "bias": False,
    "scale": "none",
    "solver": "ridge",
    "ridge": 1e-4,
    "variant": "rotate",
    "order": "sequential",
}


@dataclass
class RecoveryConfig:
    """One recovery method, evaluated (and later fine-tuned) beside the others: an entry of `recovery`.

    Besides `name` and `method` it has a field for every key a registered method's config class declares
    (added by `register`; unset: None). An entry sets only its method's keys (`method_keys`), documented on
    that class (`GhostConfig`, `LinearPatchConfig`, ...), and they are resolved to their defaults when it is
    made; setting another key is an error (`validate_recovery`) naming the key and the method's keys.

    Args:
        name: label in results; also the view name (`dense`, `pruned` and names ending in ``_ft``, the
            fine-tuned views, are reserved).
        method: a registered method: ``none`` (reads no other key), ``ghost``, ``ghost_symmetric``,
            ``linearpatch``, ``replaceme``, ``magnitude``, ``rotation``, ``rotation_through``,
            ``rotation_anchored``.
    """

    name: str = "ghost"
    method: str = "ghost"

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

    def method_config(self) -> MethodConfig:
        """This entry as its method's config (its keys only, resolved)."""
        method = get_method(self.method)
        cfg = self.resolved()
        return method.config(name=self.name, **{k: getattr(cfg, k) for k in method_keys(method)})


_OWN_FIELDS = ("name", "method")


def setting_keys() -> tuple[str, ...]:
    """The method-specific keys of `RecoveryConfig`, in field order."""
    return tuple(f.name for f in fields(RecoveryConfig) if f.name not in _OWN_FIELDS)


def method_keys(method: Method) -> dict[str, Any]:
    """The keys `method` reads (its config class's fields), with their defaults, in `RecoveryConfig`'s order."""
    keys = asdict(method.config())  # every key has a default (`register` checks)
    return {k: keys[k] for k in setting_keys() if k in keys}


def _fill_defaults(cfg: RecoveryConfig) -> None:
    if cfg.method not in _METHODS:
        return  # `validate_recovery` names the unknown method
    for key, default in method_keys(_METHODS.get(cfg.method)).items():
        if getattr(cfg, key) is None:
            setattr(cfg, key, default)


_METHODS: Registry[Method] = Registry("recovery method", "recovery method", Method)
registered, get_method = _METHODS.names, _METHODS.get


def _check_config(method: Method) -> dict[str, Any]:
    """The config class's keys and their types, refused when the class is not a `MethodConfig` dataclass,
    a key has no default or another registered method declares it with another type."""
    config = method.config
    where = f"method {method.name!r} ({origin(method)})"
    if not (isinstance(config, type) and issubclass(config, MethodConfig) and dataclasses.is_dataclass(config)):
        raise TypeError(f"{where}: config {config!r} must be a dataclass subclassing ghostdistill.methods.MethodConfig")
    hints = get_type_hints(config)
    keys = {f.name: hints[f.name] for f in fields(config) if f.name != "name"}
    unset = [f.name for f in fields(config) if f.default is MISSING and f.default_factory is MISSING]
    if unset:
        raise ValueError(
            f"{where}: keys {unset} of {config.__name__} need a default (what an entry that omits them gets)"
        )
    if "method" in keys:
        raise ValueError(f"{where}: {config.__name__} declares a key 'method', which names the method; rename it")
    for other in _METHODS:
        theirs = get_type_hints(other.config)
        clash = [k for k in keys if k in theirs and other.name != method.name and theirs[k] != keys[k]]
        if clash:
            raise ValueError(
                f"{where}: key {clash[0]!r} is {keys[clash[0]]} here and {theirs[clash[0]]} in method {other.name!r} "
                f"({origin(other)}); one key, one type: name it differently"
            )
    return keys


def register(method: Method) -> Method:
    """Make `method` available as `recovery[].method: <method.name>`, with its config class's keys; returns it."""
    if isinstance(method, Method):
        _check_config(method)
    _METHODS.register(method)
    _sync_keys()
    return method


def unregister(name: str) -> None:
    _METHODS.unregister(name)
    _sync_keys()


def _sync_keys() -> None:
    """`RecoveryConfig`'s fields: `name`, `method` and every registered method's keys (the flat config's keys
    first, in its order; the others as they were registered), each typed as its config class says, unset
    (None) by default. The dataclass is rebuilt in place, so every holder of the class sees the keys."""
    hints: dict[str, Any] = {}
    for method in _METHODS:
        hints.update({k: h for k, h in _check_config(method).items() if k not in hints})
    order = [k for k in FLAT_DEFAULTS if k in hints] + [k for k in hints if k not in FLAT_DEFAULTS]
    cls = RecoveryConfig
    own = {k: v for k, v in cls.__annotations__.items() if k in _OWN_FIELDS}
    for key in set(cls.__annotations__) - set(own) - set(order):
        delattr(cls, key)
    for attr in ("__init__", "__repr__", "__eq__", "__match_args__"):
        if attr in cls.__dict__:
            delattr(cls, attr)
    cls.__annotations__ = {**own, **{k: Optional[hints[k]] for k in order}}
    for key in order:
        setattr(cls, key, None)
    dataclass(cls)


def ships_stock(method: str | None) -> bool:
    """Whether a training-free view of `method` exports as the model's own architecture, which every serving
    stack runs (no operator module, no remote code): the dense and pruned models (`None`, ``dense``,
    ``pruned``) and the methods that declare it (`Method.ships_stock`: ``none`` and those that fold). A
    student of such a method stays stock whatever it trains: LoRA, norms, the tail and blocks are merged at
    export, and operators train within what folds (the method's `student_operator`)."""
    if method is None or method in (DENSE, PRUNED):
        return True
    return bool(get_method(method).ships_stock)
