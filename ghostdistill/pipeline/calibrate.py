"""Calibrate: choose the plan, collect every method's statistics in one dense pass, fit every gap.

    plan = planning.choose(...)            explicit layers, or a criterion on the calibration batches
    stats, tokens = collect_statistics(...)    one dense pass, float64 sums, resumable from a saved state
    fits = fit_methods(...)                the closed-form solves (sequential gaps: a student pass each)

`calibrate` runs the three in order and returns a `Calibrated`. Several processes (DDP, FSDP2) pass a
`Dist`: each rank streams its share of the batches (as many on every rank, `even_shard`) and the sums are
added before the solve, so every rank solves the same operators as one process would. The plan criteria
run every batch on every rank alike (a sharded model's forwards are collective), so every rank chooses the
plan one process would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..calibration.distributed import even_shard, sum_collectors
from ..calibration.fit import fit_methods
from ..calibration.state import STATE_FILE, SavedState, Statistics, fingerprint, load_state, save_state, to_device
from ..calibration.stream import accumulate
from ..core.executor import executor_of
from ..core.model import hidden_size
from ..core.offload import model_device
from ..core.plan import PruningPlan
from ..core.views import PrunedModel
from ..data.config import section_settings
from ..methods import Collector, RecoveryConfig, get_method, make_collectors
from ..planning import PlanConfig, Progress, choose, no_progress, repair_config
from .config import OFFLOAD_ONE_DEVICE

Batch = dict[str, torch.Tensor]


def offloaded_stop(state_path: Path | None) -> str:
    """What a calibration pass with offloaded weights that was cut short leaves (one line)."""
    kept = f"the plan is saved in {state_path}, and " if state_path is not None else ""
    return (
        "calibration stopped: with model.model.offload the statistics are collected block by block over every batch "
        f"and are complete only at the end of the pass, so none of them was saved; {kept}a rerun collects them "
        "again from the first block"
    )


@dataclass
class Dist:
    """This process among several: its rank, their number, and a sum over all of them."""

    rank: int = 0
    world: int = 1
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Whether this process writes files (rank 0; Lightning's `is_global_zero`).
    is_zero: bool = True


@dataclass
class Calibrated:
    """What calibration produced: the plan, the model's views (every method's operators registered), the
    statistics and the report sections `plan`, `calibration` and `recovery`."""

    plan: PruningPlan
    pruned: PrunedModel
    stats: Statistics
    tokens: int
    fits: dict[str, dict]
    seconds: dict[str, float] = field(default_factory=dict)


def collect_statistics(
    pruned: PrunedModel,
    recovery: list[RecoveryConfig],
    batches: list[Batch],
    saved: SavedState | None = None,
    *,
    dist: Dist = Dist(),
    checkpoint: Callable[[Statistics, int, int], None] | None = None,
    checkpoint_every: int = 0,
    progress: Progress = no_progress,
) -> tuple[Statistics, int]:
    """The per-gap statistics of every method of `recovery` from one dense pass over `batches` (continuing
    `saved` when given), each collector holding only what the entries read; returns them and the number of
    tokens seen. `checkpoint(stats, batches_done, tokens)` is called every `checkpoint_every` batches and at
    the end (one process only: partial sums of several cannot be split)."""
    llm, plan = pruned.model, pruned.plan
    device = model_device(llm)
    methods = {r.method for r in recovery}
    stats = {g.key: make_collectors(methods, hidden_size(llm), device, recovery) for g in plan.gaps}
    done, tokens = 0, 0
    if saved is not None:
        for key, collectors in saved.stats.items():
            for name, s in collectors.items():
                stats[key][name].load_state_dict(to_device(s, device))
        done, tokens = saved.batches_done, saved.tokens
    executor = executor_of(llm)
    if dist.world > 1:  # this rank's share, one batch a pass, each named by its calibration index
        mine = even_shard(batches, dist.rank, dist.world) if done < len(batches) else []
        passes = [(dist.rank + i * dist.world, [batch]) for i, batch in enumerate(mine)]
    else:
        passes = executor.passes(batches[done:], done)
        if executor.blockwise and checkpoint and passes and done == 0:
            # One pass over every batch, its sums complete only at the end: the plan is saved first, with no
            # batch done, so a pass cut short costs its statistics, not the plan (`offloaded_stop`).
            checkpoint(stats, 0, 0)
    rank = f" (rank {dist.rank})" if dist.world > 1 else ""
    for first, pass_batches in progress(passes, f"calibration statistics{rank}"):
        tokens += accumulate(llm, pruned.stack, plan.gaps, pass_batches, stats, first_batch=first, progress=progress)
        end = first + len(pass_batches)
        if dist.world == 1 and checkpoint and checkpoint_every and end % checkpoint_every == 0 and end < len(batches):
            checkpoint(stats, end, tokens)
    if dist.world > 1 and done < len(batches):  # the ranks' sums added: every rank solves from all batches
        for collectors in stats.values():
            sum_collectors(collectors, dist.reduce)
        tokens = int(dist.reduce(torch.tensor(tokens, dtype=torch.float64, device=device)).item())
    if checkpoint:
        checkpoint(stats, len(batches), tokens)
    return stats, tokens


def calibrate(
    llm: nn.Module,
    plan_cfg: PlanConfig,
    recovery: list[RecoveryConfig],
    batches: list[Batch],
    *,
    saved: SavedState | None = None,
    state_path: Path | None = None,
    state_key: str = "",
    checkpoint_every: int = 0,
    dist: Dist = Dist(),
    progress: Progress = no_progress,
    log: Callable[[str], None] = print,
    selection: list[Batch] | None = None,
    taken: list[dict] | None = None,
    phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext(),
) -> Calibrated:
    """plan → statistics → operators. With `state_path`, the statistics are saved there every
    `checkpoint_every` batches and at the end (by rank 0), under `state_key`; `saved` resumes them.
    `selection`: the held-out windows the repair-aware criteria score candidates on; `taken`: the steps
    ``repair_greedy`` starts after (`plan.greedy_from`); `phase(name)` wraps each of ``plan``, ``calibrate``
    and ``fit`` (`pipeline.run.Run.phase`: seconds and peak memory for its observers)."""
    llm.eval()
    if executor_of(llm).blockwise and dist.world > 1:
        raise ValueError(OFFLOAD_ONE_DEVICE)
    if saved is not None and dist.world > 1 and saved.batches_done < saved.batches_total:
        # Partial sums of one process cannot be split among several: only complete states are reused.
        log(f"{state_path} is incomplete and this run has {dist.world} processes; calibrating from scratch")
        saved = None
    seconds = {}
    start = time.perf_counter()
    with phase("plan"):
        plan = (
            saved.plan
            if saved is not None
            else choose(plan_cfg, llm, batches, progress, recovery=recovery, selection=selection, taken=taken)
        )
    seconds["plan_s"] = round(time.perf_counter() - start, 2)
    log(f"pruning plan ({plan.chosen_by}): remove layers {list(plan.removed)}, gaps {[g.key for g in plan.gaps]}")
    pruned = PrunedModel(llm, plan)
    if saved is not None:
        where = f" from {state_path}" if state_path is not None else " (saved statistics)"
        log(f"resuming calibration after {saved.batches_done}/{len(batches)} batches{where}")

    def checkpoint(stats: Statistics, done: int, tokens: int) -> None:
        if state_path is not None and dist.is_zero:  # every rank holds the same statistics
            save_state(state_path, state_key, plan, stats, done, len(batches), tokens)

    start = time.perf_counter()
    with phase("calibrate"):
        try:
            stats, tokens = collect_statistics(
                pruned,
                recovery,
                batches,
                saved,
                dist=dist,
                checkpoint=checkpoint,
                checkpoint_every=checkpoint_every,
                progress=progress,
            )
        except (KeyboardInterrupt, SystemExit):  # SIGINT, SIGTERM (`lit.interrupts`): say what a rerun finds
            if executor_of(llm).blockwise:
                log(offloaded_stop(state_path if dist.is_zero else None))
            raise
    seconds["statistics_s"] = round(time.perf_counter() - start, 2)
    with phase("fit"):
        # Every gap of every method solved and its view registered; each rank reads its share of the batches.
        mine, reduce = (even_shard(batches, dist.rank, dist.world), dist.reduce) if dist.world > 1 else (batches, None)
        device = model_device(llm)
        fits = fit_methods(recovery, pruned, stats, mine, hidden_size(llm), device, progress=progress, reduce=reduce)
    seconds["solve_s"] = round(sum(f["fit_s"] for f in fits.values()), 2)
    return Calibrated(plan, pruned, stats, tokens, fits, seconds)


def calibration_summary(cal: Calibrated, data: dict, fingerprint: str, windows: int) -> dict:
    """The report's `calibration` section."""
    return {
        **data,
        # Names the statistics the operators were solved from (zero-shot scores are keyed by it).
        "fingerprint": fingerprint,
        "windows": windows,
        "tokens": cal.tokens,
        # Tokens given their own map (first position) and massive activations seen, per gap.
        "token_groups": {k: groups for k, s in cal.stats.items() if (groups := token_groups(s)) is not None},
    }


def token_groups(collectors: dict[str, Collector]) -> dict | None:
    """A gap's token counts as the first method (by name) whose statistics count them reports them
    (`Method.token_groups`: ghost's and the rotations'), or None."""
    for name, collector in collectors.items():
        groups = get_method(name).token_groups(collector)
        if groups is not None:
            return groups
    return None


def run_key(cfg, llm: nn.Module) -> str:
    """The fingerprint of a run's statistics (`cfg`: its `pipeline.config.RunConfig`); results.json's
    `calibration.fingerprint`."""
    methods = {r.method for r in cfg.recovery}
    calibration = section_settings(cfg.data.calibration)
    if cfg.plan.repair_aware():
        # The plan these statistics belong to was chosen on the selection windows (and its repair method).
        calibration["selection"] = section_settings(cfg.data.selection)
        calibration["repair_method"] = repair_config(cfg.plan, cfg.recovery).settings()
    return fingerprint(
        cfg.model, llm, cfg.plan.digest_dict(), calibration, cfg.data.batch_size, methods, recovery=cfg.recovery
    )


def open_state(
    run_dir: Path,
    cfg,
    llm: nn.Module,
    warn: Callable[[str], None] | None = None,
    info: Callable[[str], None] = lambda message: None,
    reason: Callable[[str], None] | None = None,
) -> tuple[str, SavedState | None]:
    """The fingerprint of a run (`run_key`) and its usable saved state, if any, in `run_dir`; its
    collectors are sized to the run's recovery entries (`reason`: as `load_state`'s)."""
    key = run_key(cfg, llm)
    methods = {r.method for r in cfg.recovery}
    path = Path(run_dir) / STATE_FILE
    return key, load_state(path, key, methods, hidden_size(llm), warn, info, cfg.recovery, reason)
