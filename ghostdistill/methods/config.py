"""What a run does with the registered methods: validating recovery entries (`validate_recovery`) and, once the
model is known, refusing those that cannot be right on its family (`check_family`), the flat settings of older
run folders, fitting a gap (`fit_gap`) and sizing the statistics collectors (`make_collectors`,
`statistics_layout`). The configuration and the registry themselves are `methods.interface`'s."""

from __future__ import annotations

from typing import Any, get_type_hints

import torch

from ..core.options import check_value
from ..core.plan import Gap
from ..core.views import DENSE, PRUNED
from .family import FamilyFacts
from .interface import FLAT_DEFAULTS, Collector, GapFit, RecoveryConfig, get_method, method_keys, registered


def flat_settings(cfg: RecoveryConfig) -> dict[str, Any]:
    """Every key with a value, as the flat config had them: the flat keys (the method's resolved values, the
    flat defaults for the others) and the method's own later keys. What `asdict(cfg)` gave before the split,
    so a digest of it (the keys of saved zero-shot scores) comes out as it did then."""
    own = method_keys(get_method(cfg.method)) if cfg.method in registered() else {}
    flat = {key: default if getattr(cfg, key) is None else getattr(cfg, key) for key, default in FLAT_DEFAULTS.items()}
    later = {k: getattr(cfg, k) for k in own if k not in FLAT_DEFAULTS}
    return {"name": cfg.name, "method": cfg.method, **flat, **later}


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
    return get_method(cfg.method).fit(cfg.method_config(), gap, stats, hidden_size)


def identity_fit(cfg: RecoveryConfig, hidden_size: int) -> GapFit:
    """The method's map at a gap, doing nothing (a gap of a sequential fit not yet solved)."""
    return get_method(cfg.method).identity(cfg.method_config(), hidden_size)


def make_collectors(
    methods: set[str], hidden_size: int, device: torch.device | str, recovery: list[RecoveryConfig] | None = None
) -> dict[str, Collector]:
    """One collector per method that reads statistics, keyed by method name (shared by every recovery
    entry of that method: one pass, every method's statistics).

    With `recovery` (the run's entries), a method that can (one declaring `groups(cfgs)` and `all_groups`, and
    taking `groups=` in `collector`) holds only what its entries' fits read (`statistics_layout`); without it,
    every collector holds everything (any entry of the method can be fitted from it)."""
    # A method that cannot size its collector takes no `groups`.
    sized = {name: {"groups": tuple(groups)} for name, groups in statistics_layout(methods, recovery).items()}
    made = {name: get_method(name).collector(hidden_size, device, **sized.get(name, {})) for name in sorted(methods)}
    return {name: collector for name, collector in made.items() if collector is not None}


def statistics_layout(methods: set[str], recovery: list[RecoveryConfig] | None) -> dict[str, list[str]]:
    """The collectors `make_collectors(methods, ..., recovery)` sizes below everything, with the groups they
    hold: those its entries of `recovery` read, where the method can say (`Method.groups`) and that is not all
    of them (empty: every collector holds everything, the layout without `recovery`). What a saved state's
    fingerprint must name so that a state of one layout is never resumed into another."""
    out = {}
    for name in sorted(methods):
        method = get_method(name)
        cfgs = [c.method_config() for c in recovery or () if c.method == name]
        groups = method.groups(cfgs) if cfgs else None
        if groups is not None and set(groups) != set(method.all_groups):
            out[name] = list(groups)
    return out


def needs_mlp(collectors: dict[str, Collector]) -> bool:
    """Whether a method of these collectors (keyed by method name) reads the MLP output before the gap."""
    return any(name in registered() and get_method(name).needs_mlp for name in collectors)


RESERVED_NAMES = (DENSE, PRUNED)
FT_SUFFIX = "_ft"  # `distill.ft_view`: the fine-tuned view of recovery `x` is `x_ft`


def validate_recovery(configs: list[RecoveryConfig]) -> None:
    """Names unique, and every entry as `check_entry` checks it."""
    names = [c.name for c in configs]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"recovery names must be unique; repeated: {dupes}")
    for i, c in enumerate(configs):
        check_entry(c, f"recovery[{i}] {c.name!r}")


def check_entry(c: RecoveryConfig, where: str) -> None:
    """One entry: a name usable as a view name, a registered method, only keys it reads, with values of their
    types, and its config's own checks (`MethodConfig.validate`). `where` names the entry in messages."""
    if not isinstance(c.name, str) or not c.name.replace("-", "_").isidentifier():
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
    where = f"{where} ({c.method})"
    keys = method_keys(method)
    if unread := [key for key in c.options if key not in keys]:
        its = f"its keys are: {', '.join(keys)}" if keys else "it reads no key but name and method"
        raise ValueError(f"{where}: key {unread[0]!r} is not read by method {c.method!r}; {its}")
    typed = c.method_config()
    hints = get_type_hints(method.config)
    try:
        for key in keys:
            check_value(key, getattr(typed, key), hints[key])
        typed.validate()
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def recovery_entry(value: Any) -> RecoveryConfig:
    """A recovery entry of a config file or the command line (a flat mapping) as a checked `RecoveryConfig`;
    what the CLI's parser reads an entry with, so that a bad key is named before anything loads."""
    if isinstance(value, RecoveryConfig):
        return value
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"a recovery entry is a mapping such as {{name: g, method: ghost}}, got {value!r}")
    entry = RecoveryConfig(**value)
    check_entry(entry, f"entry {entry.name!r}")
    return entry


def applicable(family: FamilyFacts) -> list[str]:
    """The registered methods that can be right on `family` with their default keys (`Method.supports`)."""
    return [name for name in registered() if get_method(name).supports(get_method(name).config(), family) is None]


def check_family(configs: list[RecoveryConfig], family: FamilyFacts, repair: RecoveryConfig | None = None) -> None:
    """One line refusing every entry of `configs` (and `repair`, the plan's repair entry where it is not one
    of them) whose method cannot be right on `family` (`Method.supports`): the entries, the family, the reason
    and the methods that apply. Called before calibration, once the model (or its skeleton) is known."""
    entries = [(f"recovery[{i}] {c.name!r} ({c.method})", c) for i, c in enumerate(configs)]
    if repair is not None and all(repair.name != c.name for c in configs):
        entries.append((f"plan.repair_method {repair.name!r} ({repair.method})", repair))
    refused: dict[str, list[str]] = {}
    for where, cfg in entries:
        why = get_method(cfg.method).supports(cfg.method_config(), family)
        if why is not None:
            refused.setdefault(why, []).append(where)
    if not refused:
        return
    ok = applicable(family)
    stock = [name for name in ok if get_method(name).ships_stock]
    reasons = "; ".join(
        f"{', '.join(where)} cannot be right on {family.model_type}: {why}" for why, where in refused.items()
    )
    raise ValueError(
        f"{reasons}. The methods that apply to {family.model_type}: "
        f"{', '.join(ok)} (stock checkpoints: {', '.join(stock)}; docs/reliability.md, what applies to which family)"
    )
