"""The configuration of a recovery entry (`RecoveryConfig`: each method reads only its own keys) and the
registry of methods (`register`, `get_method`, `make_collectors`, `validate_recovery`)."""

from __future__ import annotations

import types
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import torch

from ..core.plan import Gap
from ..core.solver import SolverName
from .interface import Collector, GapFit, Method

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
            ``linearpatch``, ``replaceme``, ``magnitude``, ``rotation``, ``rotation_through``.
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


# The defaults of the flat config, before each method read only its own keys: every entry carried every
# key. Run folders written then hold them all in their config.yaml, and digests were made of them.
FLAT_DEFAULTS: dict[str, Any] = {
    "fit": "first_weighted",
    "bias": False,
    "scale": "none",
    "solver": "ridge",
    "ridge": 1e-4,
    "variant": "rotate",
    "order": "sequential",
}


def flat_settings(cfg: RecoveryConfig) -> dict[str, Any]:
    """Every key with a value, as the flat config had them: the method's resolved keys and the flat
    defaults for the others. What `asdict(cfg)` gave before the split, so a digest of it (the keys of saved
    zero-shot scores) comes out as it did then."""
    resolved = asdict(cfg.resolved())
    return {k: FLAT_DEFAULTS[k] if k in FLAT_DEFAULTS and v is None else v for k, v in resolved.items()}


def drop_flat_defaults(entry: dict[str, Any]) -> dict[str, Any]:
    """A recovery entry of a config written by the flat version (a run folder's config.yaml lists every
    key of every entry) without the keys its method does not read where they hold the flat default, so
    it validates as it ran. Any other value of an unread key stays (and is rejected: it never applied)."""
    method = _REGISTRY.get(entry.get("method", "ghost"))
    if method is None:
        return dict(entry)
    keys = method_keys(method)
    return {k: v for k, v in entry.items() if k in keys or k not in FLAT_DEFAULTS or v != FLAT_DEFAULTS[k]}


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


def fit_gap(cfg: RecoveryConfig, gap: Gap, stats: Collector | None, hidden_size: int) -> GapFit:
    """Solve one gap for one recovery entry with its registered method."""
    return get_method(cfg.method).fit(cfg, gap, stats, hidden_size)


def identity_fit(cfg: RecoveryConfig, hidden_size: int) -> GapFit:
    """The method's map at a gap, doing nothing (a gap of a sequential fit not yet solved)."""
    return get_method(cfg.method).identity(cfg, hidden_size)


def _parts(method: Method, name: str, recovery: list[RecoveryConfig] | None) -> tuple[str, ...] | None:
    """The parts of `method`'s statistics that its entries of `recovery` read, or None for all of them
    (no `recovery`, no entry of the method, or a method that cannot size its collector)."""
    cfgs = [c for c in recovery or () if c.method == name]
    if not cfgs or getattr(method, "parts", None) is None:
        return None
    parts = tuple(method.parts(cfgs))
    return None if set(parts) == set(getattr(method, "all_parts", ())) else parts


def make_collectors(
    methods: set[str],
    hidden_size: int,
    device: torch.device | str,
    recovery: list[RecoveryConfig] | None = None,
) -> dict[str, Collector]:
    """One collector per method that reads statistics, keyed by method name (shared by every recovery
    entry of that method: one pass, every method's statistics).

    With `recovery` (the run's entries), a method that can (one declaring `parts(cfgs)` and `all_parts`, and
    taking `parts=` in `collector`) holds only what its entries' fits read (`statistics_layout`); without it,
    every collector holds everything (any entry of the method can be fitted from it)."""
    out = {}
    for name in sorted(methods):
        method = get_method(name)
        parts = _parts(method, name, recovery)
        collector = (
            method.collector(hidden_size, device)
            if parts is None
            else method.collector(hidden_size, device, parts=parts)
        )
        if collector is not None:
            out[name] = collector
    return out


def statistics_layout(methods: set[str], recovery: list[RecoveryConfig] | None) -> dict[str, list[str]]:
    """The collectors `make_collectors(methods, ..., recovery)` sizes below everything, with the parts they
    hold (empty: every collector holds everything, the layout without `recovery`). What a saved state's
    fingerprint must name so that a state of one layout is never resumed into another."""
    out = {}
    for name in sorted(methods):
        parts = _parts(get_method(name), name, recovery)
        if parts is not None:
            out[name] = list(parts)
    return out


def needs_mlp(collectors: dict[str, Collector]) -> bool:
    return any(getattr(c, "needs_mlp", False) for c in collectors.values())


RESERVED_NAMES = ("dense", "pruned")
FT_SUFFIX = "_ft"  # `distill.ft_view`: the fine-tuned view of recovery `x` is `x_ft`


def _choices(hint: Any) -> tuple | None:
    """The values a ``Literal[...] | None`` hint allows (None left out), or None for other hints."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next((a for a in get_args(hint) if a is not type(None)), hint)
    return get_args(hint) if get_origin(hint) is Literal else None


def validate_recovery(configs: list[RecoveryConfig]) -> None:
    """Names unique and usable as view names; every method registered, setting only keys it reads, with
    valid values; and the method's own checks."""
    names = [c.name for c in configs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"recovery names must be unique; repeated: {dupes}")
    hints = get_type_hints(RecoveryConfig)
    for i, c in enumerate(configs):
        where = f"recovery[{i}] {c.name!r}"
        if not c.name or not c.name.replace("-", "_").isidentifier():
            raise ValueError(f"{where}: the name must be letters, digits, '_' or '-' (it names a view)")
        if c.name in RESERVED_NAMES:
            raise ValueError(f"{where}: the name is reserved for the baselines {list(RESERVED_NAMES)}; pick another")
        if c.name.endswith(FT_SUFFIX):
            raise ValueError(
                f"{where}: names ending in {FT_SUFFIX!r} are reserved for fine-tuned views (distill.methods: "
                f"[{c.name.removesuffix(FT_SUFFIX)}] makes {c.name!r}); pick another"
            )
        try:
            method = get_method(c.method)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        where = f"recovery[{i}] {c.name!r} ({c.method})"
        keys = method_keys(method)
        for key in setting_keys():
            if key not in keys and getattr(c, key) is not None:
                its = f"its keys are: {', '.join(keys)}" if keys else "it reads no key but name and method"
                raise ValueError(f"{where}: key {key!r} is not read by method {c.method!r}; {its}")
        c = c.resolved()
        for key in keys:
            value = getattr(c, key)
            valid = _choices(hints[key])
            if valid and value not in valid:
                raise ValueError(f"{where}: {key} {value!r} is not known; choose one of {valid}")
        if "bias" in keys and not isinstance(c.bias, bool):
            raise ValueError(f"{where}: bias must be true or false, got {c.bias!r}")
        if "ridge" in keys and not (isinstance(c.ridge, (int, float)) and c.ridge >= 0):
            raise ValueError(f"{where}: ridge must be a number >= 0, got {c.ridge!r}")
        method.validate(c)
