"""Lightning callbacks: `Calibration` fits the operators before any step; `Report` writes the results."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from ..analysis import analyse
from ..calibration.distributed import shard, sum_collectors
from ..calibration.fit import fit_methods
from ..calibration.stream import accumulate
from ..core.io import atomic_torch_save, json_digest
from ..core.model import decoder_stack, hidden_size, text_config
from ..core.plan import PruningPlan
from ..criteria import choose_plan
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
        key = {
            "model": asdict(pl_module.model_cfg),
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
        state = torch.load(state_path, weights_only=False) if state_path.is_file() else None
        if state is not None and state.get("fingerprint") != fingerprint:
            rank_zero_info(f"{state_path} belongs to other settings; calibrating from scratch")
            state = None
        world, rank = trainer.world_size, trainer.global_rank
        if state is not None and world > 1 and state["batches_done"] < state.get("batches_total", -1):
            # Partial sums of one process cannot be split among several: only complete states are reused.
            rank_zero_info(f"{state_path} is incomplete and this run has {world} processes; calibrating from scratch")
            state = None
        timings = pl_module.report["timings"]
        llm = pl_module.llm
        llm.eval()

        start = time.perf_counter()
        ids = dm.calibration_ids()
        timings["calibration_data_s"] = round(time.perf_counter() - start, 2)
        batches = list(dm.calibration_dataloader())

        # ---- plan
        start = time.perf_counter()
        if state is not None:
            plan = PruningPlan(**state["plan"])
        elif pl_module.plan_cfg.layers is not None:
            plan = PruningPlan.from_layers(
                pl_module.plan_cfg.layers, text_config(llm).num_hidden_layers, allow_edges=pl_module.plan_cfg.allow_edges
            )
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
        methods = {r.method for r in pl_module.recovery_cfgs}
        stats = {g.key: make_collectors(methods, c, device) for g in plan.gaps}
        done, tokens = 0, 0
        if state is not None:
            try:
                for key, collectors in state["stats"].items():
                    for name, s in collectors.items():
                        stats[key][name].load_state_dict(_to(s, device))
                done, tokens = state["batches_done"], state["tokens"]
                rank_zero_info(f"resuming calibration after {done}/{len(batches)} batches from {state_path}")
            except ValueError as err:
                # Statistics saved by an older version (a collector gained sums): the same settings, but the
                # sums must be collected again.
                rank_zero_info(f"{state_path}: {err}; calibrating from scratch")
                stats = {g.key: make_collectors(methods, c, device) for g in plan.gaps}
        start = time.perf_counter()
        reduce = (lambda t: trainer.strategy.reduce(t, reduce_op="sum")) if world > 1 else None
        if world > 1 and done < len(batches):
            # Each rank streams its share; the sums are added across ranks before the solve.
            mine = shard(batches, rank, world)
            for batch in tqdm(mine, desc=f"calibration statistics (rank {rank})", disable=not self.progress):
                tokens += accumulate(llm, pruned.stack, plan.gaps, [batch], stats)
            for collectors in stats.values():
                sum_collectors(collectors, reduce)
            tokens = int(reduce(torch.tensor(tokens, dtype=torch.float64, device=device)).item())
        else:
            bar = tqdm(total=len(batches), initial=done, desc="calibration statistics", disable=not self.progress)
            for i in range(done, len(batches)):
                tokens += accumulate(llm, pruned.stack, plan.gaps, [batches[i]], stats)
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
                    "windows": int(len(ids)),
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
            "fingerprint": fingerprint,
            "plan": {"num_layers": plan.num_layers, "removed": plan.removed, "chosen_by": plan.chosen_by,
                     "scores": plan.scores},
            "stats": {k: {name: _to(c.state_dict(), "cpu") for name, c in cs.items()} for k, cs in stats.items()},
            "batches_done": done,
            "batches_total": total,
            "tokens": tokens,
        }
        atomic_torch_save(state, path)


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

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == trainer.max_steps and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
