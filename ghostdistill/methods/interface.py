"""The interface every recovery method implements, its configuration, and the registry.

A method is a `Method` subclass with its own config class, a `MethodConfig` dataclass whose fields are the
keys its fit reads (types, defaults, documented under ``Args:``), registered together by
``register(MyMethod())`` with ``MyMethod.config = MyConfig`` (peft's pattern: one config class and one model
class per method). A recovery entry of a config file stays one flat mapping (`RecoveryConfig`), turned into its
method's config (`RecoveryConfig.method_config`) before a fit reads it.

What a method is, each member with a default on `Method` (a method overrides what it does differently):

1. `collector(hidden_size, device)`: its statistics for one gap (fixed-size float64 sums fed `GapTaps` batch
   by batch, saved and restored for resumable runs; by default a `statistics` class's), or None (it reads
   nothing). `all_groups` and `groups(cfgs)` name the groups of them the fits of `cfgs` read, for a
   `collector(..., groups=...)` that holds only those (`make_collectors(..., recovery=...)`); `needs_mlp`: its
   taps carry the MLP output of the block before the gap;
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

from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any, Literal, Protocol, get_type_hints, runtime_checkable

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
    """A recovery method (each member: module docstring); subclasses set `name` and `config`."""

    name: str = ""
    config: type[MethodConfig] = Ordered
    folds: bool = False
    folds_embedding: bool = False
    needs_mlp: bool = False
    all_groups: tuple[str, ...] = ()
    card: str = ""
    statistics: type | None = None  # its collector's class, made as `statistics(hidden_size, device=device)`

    @property
    def ships_stock(self) -> bool:
        return self.folds

    def collector(self, hidden_size: int, device: torch.device | str) -> Collector | None:
        return None if self.statistics is None else self.statistics(hidden_size, device=device)

    def groups(self, cfgs: list[MethodConfig]) -> tuple[str, ...] | None:
        """The groups of the statistics the fits of `cfgs` read; None: the collector cannot be sized."""
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


class RecoveryConfig:
    """One recovery method, evaluated (and later fine-tuned) beside the others: an entry of `recovery`.

    An entry is one flat mapping, ``{name: g, method: ghost, fit: plain}``: `name`, `method` and keys of that
    method's own config class (`Method.config`), documented there (`GhostConfig`, `LinearPatchConfig`, ...).
    The keys are not fields of this class but read through that class (its defaults for keys not given;
    `method_config` makes the typed config), so a method registered at any time brings its keys and nothing
    shared is rebuilt. `validate_recovery` refuses a key the method does not read, or a value outside its type,
    in one line naming the key and the method's keys. The CLI reads an entry as this type (`cli.fit` registers
    it with jsonargparse, read by `methods.recovery_entry`): a config file, ``--model.recovery`` and
    ``--print_config`` see the same flat mapping.

    Args:
        name: label in results; also the view name (`dense`, `pruned` and names ending in ``_ft``, the
            fine-tuned views, are reserved).
        method: a registered method: ``none`` (reads no other key), ``ghost``, ``ghost_symmetric``,
            ``linearpatch``, ``replaceme``, ``magnitude``, ``rotation``, ``rotation_through``,
            ``rotation_anchored``.
        **options: the method's keys (a None is unset: the flat version's config.yaml lists every key).
    """

    def __init__(self, name: str = "ghost", method: str = "ghost", **options: Any) -> None:
        self.name, self.method = name, method
        self.options = {k: v for k, v in options.items() if v is not None}

    def __getattr__(self, key: str) -> Any:
        """A key of the entry's method: its given value or the method's default (None: not its key)."""
        options = self.__dict__.get("options")
        if options is None or key.startswith("__"):
            raise AttributeError(key)
        if key in options:
            return options[key]
        return method_keys(_METHODS.get(self.method)).get(key) if self.method in _METHODS else None

    def __repr__(self) -> str:
        return f"RecoveryConfig({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecoveryConfig) and self.as_dict() == other.as_dict()

    def resolved(self) -> RecoveryConfig:
        """A copy with every key the method reads set (its default where not given)."""
        return RecoveryConfig(**self.as_dict())

    def settings(self) -> dict[str, Any]:
        """`name`, `method` and the resolved value of every key the method reads (what its fit sees)."""
        keys = method_keys(get_method(self.method))
        return {"name": self.name, "method": self.method, **{k: self.options.get(k, d) for k, d in keys.items()}}

    def as_dict(self) -> dict[str, Any]:
        """The entry as a config file writes it: its `settings` (and any key given that its method does not
        read, which `validate_recovery` refuses), or what was given where the method is not registered."""
        given = {"name": self.name, "method": self.method, **self.options}
        return self.settings() | given if self.method in _METHODS else given

    def method_config(self) -> MethodConfig:
        """This entry as its method's config (its keys only, resolved)."""
        method = get_method(self.method)
        return method.config(name=self.name, **{k: getattr(self, k) for k in method_keys(method)})


def setting_keys() -> tuple[str, ...]:
    """Every key a registered method reads (the flat config's keys first, in its order; the others as their
    methods were registered)."""
    keys = [k for method in _METHODS for k in method_keys(method)]
    return tuple(dict.fromkeys([k for k in FLAT_DEFAULTS if k in keys] + keys))


def method_keys(method: Method) -> dict[str, Any]:
    """The keys `method` reads (its config class's fields), with their defaults, the flat config's keys first."""
    keys = asdict(method.config())  # every key has a default (`register` checks)
    keys.pop("name")
    return {k: keys[k] for k in FLAT_DEFAULTS if k in keys} | keys


_METHODS: Registry[Method] = Registry("recovery method", "recovery method", Method)
registered, get_method, unregister = _METHODS.names, _METHODS.get, _METHODS.unregister


def _check_config(method: Method) -> None:
    """Refuse the config class when it is not a `MethodConfig` dataclass, a key has no default, or is a word
    the entry uses itself, or another registered method declares it with another type."""
    config = method.config
    where = f"method {method.name!r} ({origin(method)})"
    if not (isinstance(config, type) and issubclass(config, MethodConfig) and is_dataclass(config)):
        raise TypeError(f"{where}: config {config!r} must be a dataclass subclassing ghostdistill.methods.MethodConfig")
    hints = get_type_hints(config)
    keys = {f.name: hints[f.name] for f in fields(config) if f.name != "name"}
    if unset := [f.name for f in fields(config) if f.default is MISSING and f.default_factory is MISSING]:
        raise ValueError(
            f"{where}: keys {unset} of {config.__name__} need a default (what an entry that omits them gets)"
        )
    if taken := [k for k in keys if k in ("method", "options") or hasattr(RecoveryConfig, k)]:
        raise ValueError(f"{where}: {config.__name__} declares the key {taken[0]!r}, a word of every entry; rename it")
    for other in _METHODS:
        theirs = get_type_hints(other.config)
        if clash := [k for k in keys if k in theirs and other.name != method.name and theirs[k] != keys[k]]:
            raise ValueError(
                f"{where}: key {clash[0]!r} is {keys[clash[0]]} here and {theirs[clash[0]]} in method {other.name!r} "
                f"({origin(other)}); one key, one type: name it differently"
            )


def register(method: Method) -> Method:
    """Make `method` available as `recovery[].method: <method.name>`, with its config class's keys; returns it."""
    if isinstance(method, Method):
        _check_config(method)
    return _METHODS.register(method)


def ships_stock(method: str | None) -> bool:
    """Whether a training-free view of `method` exports as the model's own architecture, which every serving
    stack runs (no operator module, no remote code): the dense and pruned models (`None`, ``dense``,
    ``pruned``) and the methods that declare it (`Method.ships_stock`: ``none`` and those that fold). A
    student of such a method stays stock whatever it trains: LoRA, norms, the tail and blocks are merged at
    export, and operators train within what folds (the method's `student_operator`)."""
    return method is None or method in (DENSE, PRUNED) or bool(get_method(method).ships_stock)
