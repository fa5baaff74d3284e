"""`calibration_state.pt`: the calibration statistics of a run, saved while they accumulate, so an
interrupted run resumes where it stopped and `export` re-solves without a calibration pass. A run's own key
and state (`run_key`, `open_state`: they read its `RunConfig`) are `pipeline.calibrate`'s.

A state is keyed by a fingerprint of everything the statistics depend on (model, its shape and dtype,
plan settings, calibration data, batch size, methods). A file that is unreadable, of another format,
of other settings or of another layout is never reinterpreted: it is reported and recomputed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from ..core.io import atomic_torch_save, json_digest
from ..core.model import ModelConfig, decoder_stack, hidden_size, model_key
from ..core.plan import PruningPlan
from ..methods import Collector, RecoveryConfig, make_collectors, statistics_layout

STATE_FILE = "calibration_state.pt"
# Version of `calibration_state.pt`; a file of another version is recomputed, never reinterpreted.
STATE_FORMAT = 2

Statistics = dict[str, dict[str, Collector]]  # gap key -> method -> collector


@dataclass
class SavedState:
    """A usable saved state: the plan, the statistics after `batches_done` of `batches_total` batches."""

    plan: PruningPlan
    stats: dict[str, dict[str, dict]]
    batches_done: int
    batches_total: int
    tokens: int


def fingerprint(
    model_cfg: ModelConfig,
    llm: nn.Module,
    plan: dict,
    calibration: dict,
    batch_size: int,
    methods: set[str],
    recovery: list[RecoveryConfig] | None = None,
) -> str:
    """What the statistics depend on, as a digest (`plan`: the plan settings' `PlanConfig.digest_dict()`).
    `recovery`: the run's entries, when its collectors are sized to them (`make_collectors(..., recovery)`); a
    layout smaller than everything is then part of the key (one holding everything keeps the key it had)."""
    key = {
        "format": STATE_FORMAT,
        "model": model_key(model_cfg),
        # What the weights are, beyond where they came from: a folder overwritten by another model of another
        # shape must not resume from the first one's statistics.
        "shape": {
            "model_type": getattr(llm.config, "model_type", None),
            "layers": len(decoder_stack(llm).layers),
            "hidden_size": hidden_size(llm),
            "vocab_size": llm.get_output_embeddings().weight.shape[0],
            "dtype": str(next(llm.parameters()).dtype),
        },
        "plan": plan,
        "calibration": calibration,
        "batch_size": batch_size,
        "methods": sorted(methods),
    }
    if layout := statistics_layout(methods, recovery):
        key["statistics"] = layout
    return json_digest(key)


def save_state(path: Path, key: str, plan: PruningPlan, stats: Statistics, done: int, total: int, tokens: int) -> None:
    state = {
        "format": STATE_FORMAT,
        "fingerprint": key,
        "plan": {f.name: getattr(plan, f.name) for f in fields(plan)},  # what `PruningPlan(**...)` reads back
        "stats": {k: {name: to_device(c.state_dict(), "cpu") for name, c in cs.items()} for k, cs in stats.items()},
        "batches_done": done,
        "batches_total": total,
        "tokens": tokens,
    }
    atomic_torch_save(state, path)


def load_state(
    path: Path,
    key: str,
    methods: set[str],
    hidden: int,
    warn: Callable[[str], None] | None = None,
    info: Callable[[str], None] = lambda message: None,
    recovery: list[RecoveryConfig] | None = None,
    reason: Callable[[str], None] | None = None,
) -> SavedState | None:
    """The saved state at `path` when it is readable, of this format, made with fingerprint `key`, and holds for
    every gap of its plan exactly the statistics `methods` collect at hidden size `hidden` (same keys, same shapes,
    finite); otherwise None, with the reason passed to `warn` (a UserWarning by default; a file of other settings is
    only `info`): the caller calibrates from scratch and the next checkpoint replaces the file. `recovery`: the
    run's entries, when its collectors are sized to them (as for `fingerprint`). `reason`: a caller that will not
    calibrate (`export <run>`) gets the bare reason there instead, and nothing says "calibrating from scratch"."""
    warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=3))
    if not path.is_file():
        return None

    def discard(why: str) -> None:
        if reason is not None:
            return reason(why)
        warn(f"{path} {why}: not used; calibrating from scratch (the file is replaced at the next checkpoint)")

    try:
        # weights_only: a state file holds tensors, numbers and strings; nothing in it should run code.
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - truncated, corrupt, not a torch file: torch raises any of many types
        return discard(f"cannot be read ({type(err).__name__}: {str(err)[:200]})")
    if not isinstance(state, dict):
        return discard(f"holds a {type(state).__name__}, not a calibration state")
    if state.get("format") != STATE_FORMAT:
        return discard(f"is of format {state.get('format', 1)}; this version writes format {STATE_FORMAT}")
    if state.get("fingerprint") != key:
        other = "belongs to other settings (model, plan, calibration data or methods)"
        (reason or (lambda why: info(f"{path} {why}; calibrating from scratch")))(other)
        return None
    try:
        plan = PruningPlan(**state["plan"])
        done, total, tokens = state["batches_done"], state["batches_total"], state["tokens"]
        if not (isinstance(done, int) and isinstance(total, int) and 0 <= done <= total and tokens >= 0):
            raise ValueError(f"batches_done {done} of {total}, tokens {tokens}")
        gaps = [g.key for g in plan.gaps]
        if sorted(state["stats"]) != sorted(gaps):
            raise ValueError(f"statistics for gaps {sorted(state['stats'])}, plan gaps {gaps}")
        for gap in gaps:
            fresh = make_collectors(methods, hidden, "cpu", recovery)
            if sorted(state["stats"][gap]) != sorted(fresh):
                raise ValueError(f"gap {gap}: statistics of {sorted(state['stats'][gap])}, expected {sorted(fresh)}")
            for name, collector in fresh.items():
                _same_layout(collector.state_dict(), state["stats"][gap][name], f"gap {gap} {name}")
    except (KeyError, TypeError, ValueError) as err:
        return discard(f"does not hold usable statistics ({type(err).__name__}: {err})")
    return SavedState(plan, state["stats"], done, total, tokens)


def incomplete_state(run_dir: Path, saved: SavedState | None, why: list[str]) -> str:
    """The one line of a run folder whose statistics cannot serve an export: why (`load_state`'s `reason`), and
    what to do (no "calibrating from scratch": an export does not calibrate)."""
    if saved is not None:
        detail = f"it holds {saved.batches_done} of {saved.batches_total} batches: run `fit` again to finish it"
    elif why and why[0].startswith("belongs to other settings"):
        detail = (
            f"it {why[0]} than {Path(run_dir) / 'config.yaml'} gives now (was config.yaml edited after the fit?): "
            "restore config.yaml, or run `fit` with it again"
        )
    else:
        detail = f"it {why[0] if why else 'is missing'}: run `fit` again"
    return f"{Path(run_dir) / STATE_FILE} does not hold this run's complete statistics: {detail}"


def _same_layout(expected: dict, saved: dict, where: str) -> None:
    if not isinstance(saved, dict) or sorted(saved) != sorted(expected):
        raise TypeError(
            f"{where}: entries {sorted(saved) if isinstance(saved, dict) else saved!r}, expected {sorted(expected)}"
        )
    for k, v in expected.items():
        if isinstance(v, dict):
            _same_layout(v, saved[k], f"{where}.{k}")
        elif isinstance(v, torch.Tensor):
            t = saved[k]
            if not isinstance(t, torch.Tensor) or t.shape != v.shape:
                raise ValueError(f"{where}.{k}: shape {getattr(t, 'shape', t)}, expected {tuple(v.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{where}.{k} is not finite")


def to_device(state: dict, device) -> dict:
    """The same nested state with every tensor on `device`."""
    return {
        k: to_device(v, device) if isinstance(v, dict) else v.to(device) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }
