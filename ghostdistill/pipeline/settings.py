"""Which settings make a saved result stale: the one place a saved result (a run's results.json, a frontier
point, a frontier student's run) is checked against the settings it would be computed with now.

What a key means for saved results is marked where the key is defined (`core.settings`: cost-only keys, keys
added later), and read here off `RunConfig`: `result_settings` (what results.json records of a `fit`),
`frontier_settings` (what a frontier point records) and `stale` (why saved settings are not the wanted ones).
Two settings are the same when they differ only in cost-only keys, in a key one lacks and the other holds
unset (None: a key added later keeps the results saved before it), or in how a recovery entry is written (its
method's defaults left out or written). The statistics' fingerprint (`state.fingerprint`) and the plan's
digest (`PlanConfig.digest_dict`) read the same marks.
"""

from __future__ import annotations

import dataclasses
import json
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
# The sections a frontier point depends on: those of the phases it runs (the students' and the evaluation's
# other settings, views, zero-shot and analysis, only a `fit` reads).
FRONTIER_SECTIONS = ("model", "plan", "recovery", "data")


def cost_only(prefix: str = "") -> list[str]:
    """The dotted cost-only keys of a run's settings: in `fit`'s layout (``data.…``, ``model.<section>.…``), or
    each section under `prefix` (a frontier point's ``config.``)."""
    return [
        key
        for name, cls in get_type_hints(RunConfig).items()
        if dataclasses.is_dataclass(cls)
        for key in cost_keys(cls, prefix + (name if prefix or name == "data" else f"model.{name}") + ".")
    ]


def _drop(settings: Any, dotted: list[str]) -> Any:
    """A copy of `settings` as plain data without the `dotted` keys."""
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
    """Every setting of a `fit` config (as jsonargparse dumps it) that decides the results: the seed, the model
    and data sections and the trainer's result keys, the cost-only keys left out."""
    trainer = config.get("trainer") or {}
    out = {"seed_everything": config.get("seed_everything"), "model": config.get("model") or {}}
    out |= {"data": config.get("data") or {}, "trainer": {k: trainer.get(k) for k in RESULT_TRAINER_KEYS}}
    return _drop(out, cost_only())


def frontier_settings(cfg: RunConfig, criteria: list[str]) -> dict:
    """The settings a frontier point depends on: its sections (without their cost-only keys), the criteria."""
    config = {k: json.loads(json.dumps(getattr(cfg, k), default=_asdict)) for k in FRONTIER_SECTIONS}
    return _drop({"config": config, "criteria": list(criteria)}, _frontier_cost())


def _asdict(obj: Any) -> Any:
    if isinstance(obj, RecoveryConfig):
        return obj.settings()
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else str(obj)


def _frontier_cost() -> list[str]:
    return [k for k in cost_only("config.") if k.split(".")[1] in FRONTIER_SECTIONS]


def _canonical(settings: dict) -> dict:
    """The recovery entries (`model.recovery` of a run's settings, `config.recovery` of a frontier point's)
    resolved (`RecoveryConfig.settings`), however they were written."""
    for section in ("model", "config"):
        held = settings.get(section)
        if isinstance(held, dict) and isinstance(held.get("recovery"), list):
            settings = {**settings, section: {**held, "recovery": [_resolved(e) for e in held["recovery"]]}}
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
    """Why `saved` settings are not `wanted` ("other model.plan.layers and 2 more"), or None when they are;
    the keys of `ignore` (default: the cost-only ones) left out of both."""
    ignore = cost_only() if ignore is None else ignore
    saved = _canonical(_drop(saved, ignore)) if isinstance(saved, dict) else saved
    diff = differences(saved, _canonical(_drop(wanted, ignore)))
    more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
    return f"other {', '.join(diff[:6])}{more}" if diff else None


def stale_reason(results: dict, wanted: dict) -> str | None:
    """Why a run's results.json cannot be reused under `wanted` (`result_settings`), or None."""
    if results.get("settings") is None:
        return "its results.json records no settings (written by an older version)"
    other = stale(results["settings"], wanted)
    return None if other is None else f"its results.json was computed with {other}"


def stale_point(saved: dict, settings: dict) -> str | None:
    """Why a saved frontier point cannot be reused under `settings` (`frontier_settings`), or None."""
    if "settings" not in saved:
        return "records no settings (written by an older version)"
    other = stale(saved["settings"], settings, _frontier_cost())
    return None if other is None else f"was computed with {other}"
