"""Lightning callbacks: `Calibration` fits the operators before any step; `Report` writes the results."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from tqdm.auto import tqdm

from ..analysis import analyse
from ..calibration.distributed import shard, sum_collectors
from ..calibration.fit import fit_methods
from ..calibration.stream import accumulate
from ..core.io import atomic_torch_save, json_digest
from ..core.model import decoder_stack, hidden_size
from ..core.plan import PruningPlan
from ..criteria import check_plan, choose_plan
from ..data.windows import shared_ngrams
from ..methods import make_collectors
from ..reporting.results import write_report
from .module import NO_DISTILL_METHODS


class Calibration(Callback):
    """plan → statistics → operators, once, before the first step (or the first test batch).

    Statistics are checkpointed to `<run>/calibration_state.pt` every `checkpoint_every` batches, keyed
    by a fingerprint of everything they depend on, so an interrupted run resumes where it stopped. With
    several processes only rank 0 writes the file.

    Args:
        checkpoint_every: batches between statistics checkpoints (0: only at the end).
        progress: show progress bars.
    """

    STATE_FILE = "calibration_state.pt"

    def __init__(self, checkpoint_every: int = 8, progress: bool = True) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.progress = progress
        self.done = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.done:
            return
        # Before optimizers are configured, so that distillation can train the fitted operators.
        pl_module.configure_model()
        # The strategy moves the module only after setup; calibrating an 8B model on the CPU would crawl.
        pl_module.to(trainer.strategy.root_device)
        _check_strategy(trainer)
        if trainer.max_steps < 0:
            raise ValueError(
                f"trainer.max_steps={trainer.max_steps}: set 0 (training-free) or the number of distillation steps"
            )
        if trainer.max_steps > 0 and not pl_module.distill_cfg.methods:
            # Before calibration, not after it: the same message the training step would give.
            raise RuntimeError(NO_DISTILL_METHODS)
        self.calibrate(trainer, pl_module)
        if pl_module.distilling:
            # Students start from their method's closed form, before the optimizer exists.
            students = pl_module.setup_students()
            students.check_prefix(next(iter(trainer.datamodule.calibration_dataloader())))
            rank_zero_info(
                f"distilling {students.views} ({', '.join(pl_module.distill_cfg.train)}); blocks before the first "
                f"gap run {'once, shared' if students.share_prefix else 'for every student'}"
            )
        self.done = True

    def _fingerprint(self, pl_module, datamodule) -> str:
        llm = pl_module.llm
        key = {
            "format": STATE_FORMAT,
            "model": asdict(pl_module.model_cfg),
            # What the weights are, beyond where they came from: a folder overwritten by another model of
            # another shape must not resume from the first one's statistics.
            "shape": {
                "model_type": getattr(llm.config, "model_type", None),
                "layers": len(decoder_stack(llm).layers),
                "hidden_size": hidden_size(llm),
                "vocab_size": llm.get_output_embeddings().weight.shape[0],
                "dtype": str(next(llm.parameters()).dtype),
            },
            "plan": asdict(pl_module.plan_cfg),
            "calibration": asdict(datamodule.calibration),
            "batch_size": datamodule.batch_size,
            # The statistics collected depend on which methods need them.
            "methods": sorted({r.method for r in pl_module.recovery_cfgs}),
        }
        return json_digest(key)

    @torch.no_grad()
    def calibrate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dm = trainer.datamodule
        run_dir = Path(trainer.default_root_dir)
        state_path = run_dir / self.STATE_FILE
        fingerprint = self._fingerprint(pl_module, dm)
        llm = pl_module.llm
        methods = {r.method for r in pl_module.recovery_cfgs}
        state = load_state(state_path, fingerprint, methods, hidden_size(llm))
        world, rank = trainer.world_size, trainer.global_rank
        if state is not None and world > 1 and state["batches_done"] < state.get("batches_total", -1):
            # Partial sums of one process cannot be split among several: only complete states are reused.
            rank_zero_info(f"{state_path} is incomplete and this run has {world} processes; calibrating from scratch")
            state = None
        timings = pl_module.report["timings"]
        llm.eval()

        # The plan's depth checks before any data is read or generated (minutes, for `generate`).
        explicit = check_plan(pl_module.plan_cfg, len(decoder_stack(llm).layers)) if state is None else None

        start = time.perf_counter()
        ids = dm.calibration_ids()
        timings["calibration_data_s"] = round(time.perf_counter() - start, 2)
        batches = list(dm.calibration_dataloader())

        # ---- plan
        start = time.perf_counter()
        if state is not None:
            plan = PruningPlan(**state["plan"])
        elif explicit is not None:
            plan = explicit
        else:
            plan = choose_plan(
                pl_module.plan_cfg,
                llm,
                decoder_stack(llm),
                tqdm(batches, desc=f"criterion {pl_module.plan_cfg.criterion}", disable=not self.progress),
            )
        timings["plan_s"] = round(time.perf_counter() - start, 2)
        rank_zero_info(f"pruning plan ({plan.chosen_by}): remove layers {list(plan.removed)}, gaps {[g.key for g in plan.gaps]}")
        pruned = pl_module.set_plan(plan)

        # ---- statistics (resumable)
        # One pass feeds every method's collectors. Accumulate on the model's device, checkpoint on the CPU.
        device = next(llm.parameters()).device
        c = hidden_size(llm)
        stats = {g.key: make_collectors(methods, c, device) for g in plan.gaps}
        done, tokens = 0, 0
        if state is not None:
            # `load_state` checked every collector's entries and shapes against fresh ones (statistics of an
            # older version, whose collectors had other sums, were discarded there).
            for key, collectors in state["stats"].items():
                for name, s in collectors.items():
                    stats[key][name].load_state_dict(_to(s, device))
            done, tokens = state["batches_done"], state["tokens"]
            rank_zero_info(f"resuming calibration after {done}/{len(batches)} batches from {state_path}")
        start = time.perf_counter()
        reduce = (lambda t: trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else None
        if world > 1 and done < len(batches):
            # Each rank streams its share; the sums are added across ranks before the solve.
            mine = shard(batches, rank, world)
            for i, batch in enumerate(tqdm(mine, desc=f"calibration statistics (rank {rank})", disable=not self.progress)):
                tokens += accumulate(llm, pruned.stack, plan.gaps, [batch], stats, first_batch=rank + i * world)
            for collectors in stats.values():
                sum_collectors(collectors, reduce)
            tokens = int(reduce(torch.tensor(tokens, dtype=torch.float64, device=device)).item())
        else:
            bar = tqdm(total=len(batches), initial=done, desc="calibration statistics", disable=not self.progress)
            for i in range(done, len(batches)):
                tokens += accumulate(llm, pruned.stack, plan.gaps, [batches[i]], stats, first_batch=i)
                bar.update(1)
                if self.checkpoint_every and (i + 1) % self.checkpoint_every == 0 and i + 1 < len(batches):
                    self._save(trainer, state_path, fingerprint, plan, stats, i + 1, tokens, len(batches))
            bar.close()
        self._save(trainer, state_path, fingerprint, plan, stats, len(batches), tokens, len(batches))
        timings["statistics_s"] = round(time.perf_counter() - start, 2)

        # ---- operators, gap by gap (sequential fits need the earlier gaps of their own method)
        fits = fit_methods(
            pl_module.recovery_cfgs, pruned, stats, shard(batches, rank, world) if world > 1 else batches, c, device,
            progress=lambda it, desc: tqdm(it, desc=desc, disable=not self.progress),
            reduce=reduce,
        )
        timings["solve_s"] = round(sum(f["fit_s"] for f in fits.values()), 2)

        ghost_counts = {k: vars(s["ghost"].counts) for k, s in stats.items() if "ghost" in s}
        pl_module.report.update(
            {
                "plan": plan.to_dict(),
                "calibration": {
                    **dm.describe()["calibration"],
                    # Names the statistics the operators were solved from (zero-shot scores are keyed by it).
                    "fingerprint": fingerprint,
                    "windows": len(ids),
                    "tokens": tokens,
                    # Tokens given their own map (first position) and massive activations seen, per gap.
                    "token_groups": ghost_counts,
                },
                "recovery": fits,
            }
        )

    @staticmethod
    def _save(
        trainer: Trainer, path: Path, fingerprint: str, plan: PruningPlan, stats: dict, done: int, tokens: int,
        total: int,
    ) -> None:
        if not trainer.is_global_zero:
            return  # only rank 0 writes; every rank holds the same statistics
        state = {
            "format": STATE_FORMAT,
            "fingerprint": fingerprint,
            "plan": {"num_layers": plan.num_layers, "removed": plan.removed, "chosen_by": plan.chosen_by,
                     "scores": plan.scores},
            "stats": {k: {name: _to(c.state_dict(), "cpu") for name, c in cs.items()} for k, cs in stats.items()},
            "batches_done": done,
            "batches_total": total,
            "tokens": tokens,
        }
        atomic_torch_save(state, path)


# Version of `calibration_state.pt`; a file of another version is recomputed, never reinterpreted.
STATE_FORMAT = 2


def load_state(path: Path, fingerprint: str, methods: set[str], hidden: int) -> dict | None:
    """The saved calibration state at `path` when it is readable, of this format, made with `fingerprint`,
    and holds for every gap of its plan exactly the statistics `methods` collect at hidden size `hidden`
    (same keys, same shapes, finite); otherwise None, with the reason logged: the caller calibrates from
    scratch and the next checkpoint replaces the file."""
    if not path.is_file():
        return None
    try:
        # weights_only: a state file holds tensors, numbers and strings; nothing in it should run code.
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - truncated, corrupt, not a torch file: torch raises any of many types
        return _discard(path, f"cannot be read ({type(err).__name__}: {str(err)[:200]})")
    if not isinstance(state, dict):
        return _discard(path, f"holds a {type(state).__name__}, not a calibration state")
    if state.get("format") != STATE_FORMAT:
        return _discard(path, f"is of format {state.get('format', 1)}; this version writes format {STATE_FORMAT}")
    if state.get("fingerprint") != fingerprint:
        rank_zero_info(f"{path} belongs to other settings (model, plan, calibration data or methods); calibrating from scratch")
        return None
    try:
        plan = PruningPlan(**state["plan"])
        done, total, tokens = state["batches_done"], state["batches_total"], state["tokens"]
        if not (isinstance(done, int) and isinstance(total, int) and 0 <= done <= total and tokens >= 0):
            raise ValueError(f"batches_done {done} of {total}, tokens {tokens}")
        gaps = [g.key for g in plan.gaps]
        if sorted(state["stats"]) != sorted(gaps):
            raise ValueError(f"statistics for gaps {sorted(state['stats'])}, plan gaps {gaps}")
        for key in gaps:
            fresh = make_collectors(methods, hidden, "cpu")
            if sorted(state["stats"][key]) != sorted(fresh):
                raise ValueError(f"gap {key}: statistics of {sorted(state['stats'][key])}, expected {sorted(fresh)}")
            for name, collector in fresh.items():
                _same_layout(collector.state_dict(), state["stats"][key][name], f"gap {key} {name}")
    except (KeyError, TypeError, ValueError) as err:
        return _discard(path, f"does not hold usable statistics ({type(err).__name__}: {err})")
    return state


def _same_layout(expected: dict, saved: dict, where: str) -> None:
    if not isinstance(saved, dict) or sorted(saved) != sorted(expected):
        raise TypeError(f"{where}: entries {sorted(saved) if isinstance(saved, dict) else saved!r}, expected {sorted(expected)}")
    for k, v in expected.items():
        if isinstance(v, dict):
            _same_layout(v, saved[k], f"{where}.{k}")
        elif isinstance(v, torch.Tensor):
            t = saved[k]
            if not isinstance(t, torch.Tensor) or t.shape != v.shape:
                raise ValueError(f"{where}.{k}: shape {getattr(t, 'shape', t)}, expected {tuple(v.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{where}.{k} is not finite")


def _discard(path: Path, why: str) -> dict | None:
    """Log why the state at `path` is not used; the caller calibrates from scratch (returns None)."""
    rank_zero_warn(f"{path} {why}: not used; calibrating from scratch (the file is replaced at the next checkpoint)")
    return None


def _check_strategy(trainer: Trainer) -> None:
    """Strategies the views work with: single device, DDP, FSDP2 (`ModelParallelStrategy`)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "FSDPStrategy (FSDP1) wraps the decoder blocks in new modules, which the views' block references "
            "would bypass, and it costs gradient memory for frozen parameters that share a unit with trainable "
            "ones: use FSDP2, `trainer.strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy, "
            "init_args: {save_distributed_checkpoint: false}}`, or ddp"
        )
    if isinstance(strategy, ModelParallelStrategy) and strategy._save_distributed_checkpoint:
        raise ValueError(
            "ModelParallelStrategy: set init_args.save_distributed_checkpoint: false. Checkpoints hold only what "
            "trains, and a sharded checkpoint must hold every weight of the model to load"
        )
    if "deepspeed" in type(strategy).__name__.lower() and getattr(strategy, "zero_stage_3", False):
        raise ValueError("DeepSpeed ZeRO-3 with the teacher inside the module crashes in Lightning; use ZeRO-2, ddp or FSDP2")


def _to(state: dict, device) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _to(v, device)
        elif isinstance(v, torch.Tensor):
            out[k] = v.to(device)
        else:
            out[k] = v
    return out


class Report(Callback):
    """Sets up the test metrics, then writes results.json, results.md and results.png to the run folder."""

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.setup_test_metrics(trainer.datamodule.test_sources)
        self._start = time.perf_counter()

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pl_module.report["timings"]["evaluation_s"] = round(time.perf_counter() - self._start, 2)
        start = time.perf_counter()
        pl_module.evaluate_zeroshot(Path(trainer.default_root_dir) / "zeroshot")
        if pl_module.eval_cfg.zeroshot.enabled:
            pl_module.report["timings"]["zeroshot_s"] = round(time.perf_counter() - start, 2)
        if trainer.is_global_zero and pl_module.eval_cfg.analysis and pl_module.pruned is not None:
            start = time.perf_counter()
            pl_module.report["analysis"] = self.analysis(trainer, pl_module)
            pl_module.report["timings"]["analysis_s"] = round(time.perf_counter() - start, 2)
        if trainer.is_global_zero:
            report = {
                "model": asdict(pl_module.model_cfg),
                **pl_module.report,
                "evaluation": trainer.datamodule.eval_summary(),
            }
            paths = write_report(Path(trainer.default_root_dir), report)
            rank_zero_info("results written to " + ", ".join(str(p) for p in paths))


    @staticmethod
    @torch.no_grad()
    def analysis(trainer: Trainer, pl_module: LightningModule) -> dict:
        """Anatomy and held-out alignment of every method (`ghostdistill.analysis.analyse`) on the first
        `evaluation.analysis_windows` windows of the first evaluation source, less any that share a
        32-token run with the calibration windows (so they are held out even when both come from one text)."""
        dm = trainer.datamodule
        windows = dm.eval_ids(dm.evaluation.sources[0])[: pl_module.eval_cfg.analysis_windows]
        overlap = set(shared_ngrams(windows, dm.calibration_ids()))
        held_out = windows[[i for i in range(len(windows)) if i not in overlap]]
        if len(held_out) == 0:
            return {"held_out_windows": 0, "overlapping_windows": len(overlap), "gaps": {}}
        batches = [{"input_ids": b} for b in held_out.split(dm.batch_size)]
        views = [v for v in pl_module.pruned.views if v != "dense"]
        return {**analyse(pl_module.pruned, views, batches), "overlapping_windows": len(overlap),
                "source": dm.evaluation.sources[0].label}


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` in the run's `checkpoints/` folder every `every_n_train_steps` and after the final step
    (what `--ckpt_path last` resumes from); the module keeps only trainable tensors in it."""

    def __init__(self, dirpath: Path, every_n_train_steps: int) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps,
                         save_on_train_epoch_end=False)

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Written beside the target, then renamed: an interrupted save leaves the previous `last.ckpt`."""
        tmp = f"{filepath}.tmp"
        super()._save_checkpoint(trainer, tmp)
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            os.replace(tmp, filepath)
        trainer.strategy.barrier()
        self._last_checkpoint_saved = filepath

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        """What `--ckpt_path last` may resume from: only checkpoints that load and were written by this
        module. A truncated, corrupt or foreign `last.ckpt` is renamed `<name>.unusable` with a warning,
        and Lightning then starts distillation from step 0 instead of failing deep inside its restore (a
        checkpoint of other settings that loads is refused later by `GhostDistill.on_load_checkpoint`)."""
        usable = set()
        for path in super()._find_last_checkpoints(trainer):
            why = checkpoint_problem(path)
            if why is None:
                usable.add(path)
                continue
            if trainer.is_global_zero:
                os.replace(path, f"{path}.unusable")
            rank_zero_warn(f"{path} {why}: moved to {path}.unusable; distillation starts from step 0")
        # No barrier: every rank checks the file itself and comes to the same answer (a rank that looks after
        # rank 0 renamed it finds nothing).
        return usable

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == trainer.max_steps and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the Lightning checkpoint at `path` cannot be resumed from (unreadable, or not written by
    `GhostDistill`), or None when it can."""
    try:
        # Lightning's own checkpoints hold optimizer and callback state; the file is the run's own output.
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 - any failure to load means the same: not resumable
        return f"cannot be read ({type(err).__name__}: {str(err)[:200]})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "global_step" not in ckpt:
        return "is not a Lightning checkpoint"
    if "ghostdistill" not in ckpt:
        return "was not written by ghostdistill (no 'ghostdistill' entry: an older format or another program)"
    return None
