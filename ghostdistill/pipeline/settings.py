"""Which settings make a saved result stale: the one place a saved result (a run's results.json, a frontier
point, a frontier student) is checked against the settings it would be computed with now.

What a key means for saved results is marked where the key is defined (`core.settings`: cost-only keys,
keys added later); this module reads the marks off `RunConfig`:

    result_settings(config)     what results.json records of a parsed `fit` (the seed, the model and data
                                sections, the trainer's result keys), without the cost-only keys
    run_settings(cfg, rest)     the same of a typed `RunConfig` and the rest of a parsed `fit`
    frontier_settings(cfg, …)   what a frontier point records (the sections its phases read)
    stale(saved, wanted, …)     why saved settings are not these ("other model.recovery and 2 more"), or None

Two settings compare equal when they differ only in cost-only keys, or in a key one of them lacks and the
other holds unset (None): a key added later does not make the results saved before it stale. The statistics'
fingerprint (`state.fingerprint`) and the plan's digest (`PlanConfig.digest_dict`) read the same marks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import fields
from typing import Any, get_type_hints

from ..core.settings import cost_keys
from ..methods import RecoveryConfig, drop_flat_defaults
from .config import RunConfig

# The trainer's keys that decide a result (the rest: devices, logging, progress, the run folder).
RESULT_TRAINER_KEYS = (
    "max_steps",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
)
# The sections of `RunConfig` a frontier point depends on: the phases it runs (plan, calibrate, fit, evaluate);
# the students' settings and the evaluation's others (views, zero-shot, analysis) only a `fit` reads.
FRONTIER_SECTIONS = ("model", "plan", "recovery", "data")


def _layout(section: str) -> str:
    """Where a `RunConfig` section sits in `fit`'s config: ``data`` at the top, the others under ``model``."""
    return section if section == "data" else f"model.{section}"


def cost_only(layout=_layout) -> list[str]:
    """The dotted cost-only keys of a run's settings, each section placed by `layout`."""
    hints = get_type_hints(RunConfig)
    return [
        key
        for f in fields(RunConfig)
        if dataclasses.is_dataclass(hints[f.name])
        for key in cost_keys(hints[f.name], layout(f.name) + ".")
    ]


def _drop(settings: Any, dotted: list[str]) -> Any:
    """A copy of `settings` (plain data) without the `dotted` keys."""
    out = json.loads(json.dumps(settings, default=str))
    for key in dotted:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


def result_settings(config: dict) -> dict[str, Any]:
    """Every setting of a `fit` config (as jsonargparse dumps it) that decides the results: the seed, the
    model and data sections, and the trainer's result keys; the cost-only keys left out."""
    out = {
        "seed_everything": config.get("seed_everything"),
        "model": config.get("model") or {},
        "data": config.get("data") or {},
        "trainer": {k: (config.get("trainer") or {}).get(k) for k in RESULT_TRAINER_KEYS},
    }
    return _drop(out, cost_only())


def frontier_settings(cfg: RunConfig, criteria: list[str]) -> dict:
    """The settings a frontier point depends on, as plain data: the sections its phases read (without their
    cost-only keys) and the criteria."""
    config = {k: _plain(getattr(cfg, k)) for k in FRONTIER_SECTIONS}
    return _drop({"config": config, "criteria": list(criteria)}, _frontier_cost())


def _frontier_cost() -> list[str]:
    return [k for k in cost_only(lambda section: f"config.{section}") if k.split(".")[1] in FRONTIER_SECTIONS]


def _canonical(settings: dict) -> dict:
    """`model.recovery`'s entries resolved (`RecoveryConfig.settings`): an entry that leaves its method's
    defaults out and one that writes them (a typed run's) are the same settings."""
    model = settings.get("model")
    if isinstance(model, dict) and isinstance(model.get("recovery"), list):
        settings = {**settings, "model": {**model, "recovery": [_resolved(e) for e in model["recovery"]]}}
    return settings


def _resolved(entry: Any) -> Any:
    try:
        return RecoveryConfig(**drop_flat_defaults(entry)).settings()
    except (TypeError, ValueError):
        return entry  # not an entry this version can read: compared as it is


def _same(a: Any, b: Any) -> bool:
    """Equal, a key absent on one side counting as unset (None) there."""
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same(a.get(k), b.get(k)) for k in {*a, *b})
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def differences(saved: dict | None, wanted: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two settings (a list differs as a whole)."""
    if not isinstance(saved, dict):
        return [prefix.rstrip(".") or "(all settings)"]
    out: list[str] = []
    for key in dict.fromkeys([*wanted, *saved]):
        a, b = saved.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif not _same(a, b):
            out.append(f"{prefix}{key}")
    return out


def stale(saved: dict | None, wanted: dict, ignore: list[str] | None = None) -> str | None:
    """Why `saved` settings are not `wanted` ones, as a phrase for a message ("other model.plan.layers and 2
    more"), or None when they match; the keys of `ignore` (cost-only keys: `cost_only()` by default) are left
    out of both."""
    ignore = cost_only() if ignore is None else ignore
    saved = _canonical(_drop(saved, ignore)) if isinstance(saved, dict) else saved
    diff = differences(saved, _canonical(_drop(wanted, ignore)))
    if not diff:
        return None
    more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
    return f"other {', '.join(diff[:6])}{more}"


def stale_reason(results: dict, wanted: dict) -> str | None:
    """Why a run's existing results.json cannot be reused under the settings `wanted` (`result_settings` of
    the fit that would run now), or None when it was computed with exactly them."""
    saved = results.get("settings")
    if saved is None:
        return "its results.json records no settings (written by an older version)"
    other = stale(saved, wanted)
    return None if other is None else f"its results.json was computed with {other}"


def stale_point(saved: dict, settings: dict) -> str | None:
    """Why a saved frontier point cannot be reused under `settings`, or None when it was computed with them."""
    if "settings" not in saved:
        return "records no settings (written by an older version)"
    other = stale(saved["settings"], settings, _frontier_cost())
    return None if other is None else f"was computed with {other}"


def _plain(obj: Any) -> Any:
    return [dataclasses.asdict(x) for x in obj] if isinstance(obj, list) else dataclasses.asdict(obj)
