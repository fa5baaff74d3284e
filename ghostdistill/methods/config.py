"""What a run does with the registered methods: validating recovery entries (`validate_recovery`), the
flat settings of older run folders, fitting a gap (`fit_gap`) and sizing the statistics collectors
(`make_collectors`, `statistics_layout`). The configuration and the registry themselves are
`methods.interface`'s."""

from __future__ import annotations

import types
from dataclasses import asdict
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import torch

from ..core.plan import Gap
from .interface import Collector, GapFit, Method, RecoveryConfig, get_method, method_keys, registered, setting_keys

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
    name = entry.get("method", "ghost")
    if name not in registered():
        return dict(entry)
    keys = method_keys(get_method(name))
    return {k: v for k, v in entry.items() if k in keys or k not in FLAT_DEFAULTS or v != FLAT_DEFAULTS[k]}


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
