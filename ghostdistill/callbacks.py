"""Lightning callbacks: `Calibration` fits the operators before any step; `Report` writes the results."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from .calibration import accumulate, accumulate_students
from .criterion import choose_plan
from .io import atomic_torch_save, json_digest
from .model import decoder_stack, hidden_size
from .plan import PruningPlan
from .recovery import fit_gap, identity_fit
from .statistics import make_collectors
from .report import write_report


class Calibration(Callback):
    """plan → statistics → operators, once, before the first step (or the first test batch).

    Statistics are checkpointed to `<run>/calibration_state.pt` every `checkpoint_every` batches, keyed
    by a fingerprint of everything they depend on, so an interrupted run resumes where it stopped.

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
        self.calibrate(trainer, pl_module)
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
                pl_module.plan_cfg.layers, llm.config.num_hidden_layers, allow_edges=pl_module.plan_cfg.allow_edges
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
            for key, collectors in state["stats"].items():
                for name, s in collectors.items():
                    stats[key][name].load_state_dict(_to(s, device))
            done, tokens = state["batches_done"], state["tokens"]
            rank_zero_info(f"resuming calibration after {done}/{len(batches)} batches from {state_path}")
        start = time.perf_counter()
        bar = tqdm(total=len(batches), initial=done, desc="calibration statistics", disable=not self.progress)
        for i in range(done, len(batches)):
            tokens += accumulate(llm, pruned.stack, plan.gaps, [batches[i]], stats)
            bar.update(1)
            if self.checkpoint_every and (i + 1) % self.checkpoint_every == 0 and i + 1 < len(batches):
                self._save(state_path, fingerprint, plan, stats, i + 1, tokens)
        bar.close()
        self._save(state_path, fingerprint, plan, stats, len(batches), tokens)
        timings["statistics_s"] = round(time.perf_counter() - start, 2)

        # ---- operators, gap by gap (sequential fits need the earlier gaps of their own method)
        fits = self._fit_methods(pl_module.recovery_cfgs, pruned, plan, stats, batches, c, device)
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

    def _fit_methods(self, cfgs, pruned, plan, stats, batches, hidden: int, device) -> dict:
        """Fit every gap of every method and register each method's view; returns what each fit cost.

        Sequentially, gap k's statistics come from a fresh pass through the student whose gaps before k
        are already repaired by the same method; one dense pass per batch serves all methods (the first
        gap sees dense activations either way, so it reuses the shared statistics). A method's `fit_s`
        is its own student passes and solves plus an equal share of the dense passes.
        """
        gaps = plan.gaps
        fits = {cfg.name: {g.key: identity_fit(cfg, hidden) for g in gaps} for cfg in cfgs}
        seconds = dict.fromkeys(fits, 0.0)

        def register(cfg) -> None:
            pruned.add_method(
                cfg.name,
                {key: f.operator for key, f in fits[cfg.name].items() if f.operator is not None},
                {key: f.mlp_map for key, f in fits[cfg.name].items() if f.mlp_map is not None},
            )

        for cfg in cfgs:  # in config order, which is the order of the views in every report
            register(cfg)
        for k, gap in enumerate(gaps):
            collectors = {cfg.name: stats[gap.key].get(cfg.method) for cfg in cfgs}
            sequential = [cfg for cfg in cfgs if cfg.method != "none" and cfg.order == "sequential" and k > 0]
            if sequential:
                for cfg in sequential:
                    register(cfg)
                    collectors[cfg.name] = make_collectors({cfg.method}, hidden, device)[cfg.method]
                names = ", ".join(cfg.name for cfg in sequential)
                spent = accumulate_students(
                    pruned,
                    gap,
                    tqdm(batches, desc=f"student statistics for gap {gap.key} ({names})", disable=not self.progress),
                    {cfg.name: {cfg.method: collectors[cfg.name]} for cfg in sequential},
                )
                for cfg in sequential:
                    seconds[cfg.name] += spent[cfg.name] + spent["dense"] / len(sequential)
            for cfg in cfgs:
                start = time.perf_counter()
                fits[cfg.name][gap.key] = fit_gap(cfg, gap, collectors[cfg.name], hidden)
                seconds[cfg.name] += time.perf_counter() - start
        for cfg in cfgs:
            register(cfg)
        return {cfg.name: {**asdict(cfg), "fit_s": round(seconds[cfg.name], 2)} for cfg in cfgs}

    @staticmethod
    def _save(path: Path, fingerprint: str, plan: PruningPlan, stats: dict, done: int, tokens: int) -> None:
        state = {
            "fingerprint": fingerprint,
            "plan": {"num_layers": plan.num_layers, "removed": plan.removed, "chosen_by": plan.chosen_by,
                     "scores": plan.scores},
            "stats": {k: {name: _to(c.state_dict(), "cpu") for name, c in cs.items()} for k, cs in stats.items()},
            "batches_done": done,
            "tokens": tokens,
        }
        atomic_torch_save(state, path)


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
        if trainer.is_global_zero:
            report = {
                "model": asdict(pl_module.model_cfg),
                **pl_module.report,
                "evaluation": trainer.datamodule.eval_summary(),
            }
            paths = write_report(Path(trainer.default_root_dir), report)
            rank_zero_info("results written to " + ", ".join(str(p) for p in paths))
