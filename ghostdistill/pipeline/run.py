"""One run, top to bottom: `Run` holds a run's state and its phases, and owns the order they run in.

    run = Run(cfg)                       a complete `RunConfig` (data included), validated once, never patched
    run.prepare(run_dir)                 every phase before the first step or scored batch, in this order:
      run.setup(run_dir)                   load the model (and its tokenizer), bind the data; the methods' family and the plan's depth checks
      place()                              the caller puts the model where it computes (Lightning: its module and device)
      run.calibrate()                      plan → calibrate (statistics, resumable) → fit (every method's operators)
      run.build_students()                 when distilling: the `<method>_ft` students from their closed forms
    run.distill_step(batch)              … one step of every student (the loop's: Lightning's)
    run.validate(step), run.curve(step)  … held-out KL and perplexity, each student's best step; the budget curve
    run.end_distillation(step)           … `keep: best`, the report's `distill` section
    run.start_evaluation() / score_batch / finish_evaluation      (or `run.evaluate()` in one process)
    run.finish(step)                     zero-shot, the analyses, the report: the phases after evaluation, in order
    run.export(views, root)

`run.execute(run_dir)` is the whole training-free run in one process: prepare, evaluate, finish (the Python
API's runs). The Lightning layer (`ghostdistill.lit`) owns the loop, the devices and the checkpoints: its
callbacks call `prepare` before the loop and `finish` after the test loop, nothing else; `frontier`,
`export <run>` and `tests/test_phases.py` call the phases without a Trainer.
Why one object: the state a run builds (model, views, students, report) used to travel through
attributes of the LightningModule and the callbacks, and the order of the phases was implicit in
Lightning's hook order; here both are written down once.
Every phase is timed for the run's observers and results.json's `phases` (`pipeline.phases`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..calibration.state import STATE_FILE, incomplete_state
from ..core.executor import Executor, executor_of
from ..core.model import decoder_stack, hidden_size, load_model, load_tokenizer, model_key, padded
from ..core.offload import model_device
from ..core.sharded import load_sharded
from ..core.views import DENSE
from ..data.run import RunData
from ..evaluation.scores import ScoreStore
from ..evaluation.tally import ViewTally
from ..export.options import ExportOptions
from ..methods import flat_settings
from ..planning import check_plan, greedy_steps, no_progress
from ..reporting.flags import view_warnings
from ..reporting.report import RunReport
from ..reporting.results import check_scored, markdown_table, rank_warning, write_report
from .calibrate import Dist, calibrate, calibration_summary, open_state, run_key
from .config import RunConfig
from .evaluate import analysis, evaluate, score_batches, view_digests, view_results, zeroshot
from .export import export_views
from .phases import PhaseObserver as PhaseObserver
from .phases import Phases
from .phases import observe as observe
from .train import BestSteps, DistillPhases


def fit_device(accelerator: str | None = "auto") -> str:
    """Where a run outside the Trainer is put: the GPU for accelerator auto, gpu and cuda when torch sees one."""
    return "cuda" if str(accelerator or "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


class Run(Phases, DistillPhases):
    """One run's state and phases. `log`/`warn`: where messages go (rank 0's logger under Lightning);
    `write`: whether this process writes files (rank 0 of several). `model`/`tokenizer`: objects already
    loaded (the Python API's), used instead of loading `cfg.model` (which then only names them); the model is
    put in eval mode and frozen, as a loaded one is."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        observers: list[PhaseObserver] = (),
        log: Callable[[str], None] = print,
        warn: Callable[[str], None] | None = None,
        progress=no_progress,
        write: bool = True,
    ) -> None:
        cfg.validate()
        self.cfg, self.log, self.warn, self.progress, self.write = cfg, log, warn, progress, write
        self.observers = list(observers)
        self.tokenizer = load_tokenizer(cfg.model) if tokenizer is None else padded(tokenizer)
        self.report = RunReport(model=asdict(cfg.model))
        self.llm: torch.nn.Module | None = None if model is None else model.eval().requires_grad_(False)
        self.run_dir: Path | None = None
        self.data: RunData | None = None
        self.key: str | None = None  # the calibration statistics' fingerprint
        self.seed: int | None = None  # the run's seed (`seed_everything`), which exports record
        self.pruned = self.students = self.tally = None
        self.tracker, self.last_validated = BestSteps(), None
        self._batches: list = []
        self._since: dict[str, float] = {}
        # The compute device an offloaded model's blocks are brought to (the strategy's, under Lightning).
        self.device: torch.device | None = None
        self._pending: list = []  # evaluation batches held for one block-by-block pass (offloaded weights)

    # ------------------------------------------------------------------ setup
    def load(self, mesh=None, device=None) -> torch.nn.Module:
        """The model, frozen (once); with a device `mesh` (FSDP2), every decoder block sharded over it from
        the start, on `device` (`core.sharded.load_sharded`: no process holds the whole model; offloaded weights
        with FSDP2 are refused before, by `RunConfig.preflight`)."""
        if self.llm is None:
            with self.phase("load"), self.report.timed("load_model"):
                cfg = self.cfg.model
                llm = load_model(cfg, self.device) if mesh is None else load_sharded(cfg, mesh, device)
                self.llm = llm.requires_grad_(False)
        return self.llm

    @property
    def executor(self) -> Executor:
        """How the phases' passes run on the model as it is held now (`core.executor`)."""
        return executor_of(self.llm)

    @property
    def sharded(self) -> bool:
        """Whether the model's blocks are sharded (FSDP2): every rank then joins every forward and export."""
        return self.llm is not None and self.executor.mode == "sharded"

    def setup(self, run_dir: Path | None = None, *, distilling: bool = False, checks: bool = True) -> RunData:
        """Load the model, bind the data to its tokenizer and dense model (windows are made on first use)
        and, with `checks`, what needs only the model's family and depth and the tokenizer (every recovery
        method right on this family: `RunConfig.check_family`), before any text is generated."""
        with self.phase("setup"):
            llm = self.load()
            self.run_dir = Path(run_dir) if run_dir is not None else None
            if checks:
                self.cfg.check_family(llm)
                check_plan(self.cfg.plan, len(decoder_stack(llm).layers))
            self.data = RunData(
                self.cfg.data,
                self.tokenizer,
                self.run_dir,
                dense=lambda: self.pruned.use(DENSE) if self.pruned is not None else nullcontext(llm),
                model_key=model_key(self.cfg.model),
                write=self.write,
                progress=self.progress,
            )
            if checks:
                self.data.check_before_calibration(getattr(llm.config, "max_position_embeddings", None), distilling)
        return self.data

    def prepare(
        self,
        run_dir: Path | None = None,
        *,
        distilling: bool = False,
        dist: Dist = Dist(),
        checkpoint_every: int = 0,
        place: Callable[[], None] | None = None,
    ) -> None:
        """Every phase before the first step or scored batch, in order: `setup`, then `place()` (the caller puts
        the loaded model where it computes: Lightning registers it with the module and moves it to the
        strategy's device, as calibrating an 8B model on the CPU would crawl), `calibrate` (checkpointed every
        `checkpoint_every` batches), and when `distilling` the students, from their closed forms, before any
        optimizer exists."""
        self.setup(run_dir, distilling=distilling)
        if place is not None:
            place()
        self.calibrate(dist=dist, checkpoint_every=checkpoint_every)
        if distilling:
            self.build_students()

    def execute(self, run_dir: Path | None = None, *, device=None, evaluate: bool = True) -> Run:
        """The whole run training-free, in this process: `prepare`, then (with `evaluate`) every view scored and
        `finish`. `run_dir`: the run folder (statistics resume from it, results are written there); None keeps
        everything in memory. `device`: where the model runs (None: where it is). Its numbers are `fit`'s with
        `trainer.max_steps: 0`: evaluation in one process is what the test loop does batch by batch
        (`tests/test_phases.py`). Distillation needs the loop: `lit.trainer.fit_run`."""
        llm = self.load()
        self.prepare(run_dir, place=None if device is None else lambda: llm.to(device))
        if evaluate:
            self.evaluate()
            self.finish()
        return self

    # ---------------------------------------------------- plan, calibrate, fit
    def calibrate(self, *, dist: Dist = Dist(), checkpoint_every: int = 0, saved_only: bool = False) -> None:
        """plan → statistics → operators, resuming (and checkpointing) `<run>/calibration_state.pt`.
        `saved_only`: only from a complete saved state (a finished run re-solved: `export <run>`)."""
        cfg, llm, data = self.cfg, self.llm, self.data
        with self.report.timed("calibration_data"):
            batches = data.calibration_batches()
        # The repair-aware criteria score candidates on held-out windows (read before any statistics).
        selection = data.selection_batches() if cfg.plan.repair_aware() and not saved_only else None
        # repair_greedy's first steps from an earlier run of these settings: a hand-edited or foreign one is
        # refused before this run's saved state is read (and said to be recomputed).
        taken = greedy_steps(cfg.plan, lambda n: run_key(cfg.at_depth(n), llm)) if not saved_only else None
        why: list[str] = []  # from a run folder (`saved_only`): why its statistics cannot serve, said once
        if self.run_dir is not None:
            reason = why.append if saved_only else None
            self.key, saved = open_state(self.run_dir, cfg, llm, self.warn, self.log, reason)
        else:
            self.key, saved = run_key(cfg, llm), None
        if saved_only and (saved is None or saved.batches_done < saved.batches_total):
            raise ValueError(incomplete_state(self.run_dir, saved, why))
        taken = taken if saved is None else None  # a resumed state has its plan already
        cal = calibrate(
            llm,
            cfg.plan,
            cfg.recovery,
            batches,
            saved=saved,
            state_path=None if saved_only or self.run_dir is None else self.run_dir / STATE_FILE,
            state_key=self.key,
            checkpoint_every=checkpoint_every,
            dist=dist,
            progress=self.progress,
            log=self.log,
            selection=selection,
            taken=taken,
            phase=self.phase,
        )
        self.pruned, self._batches = cal.pruned, batches
        report = self.report
        report.timings.update(cal.seconds)
        report.plan = cal.plan.to_dict()
        describe = cfg.data.describe()["calibration"]
        report.calibration = calibration_summary(cal, describe, self.key, len(data.calibration_ids()))
        report.calibration["hidden_size"] = hidden_size(llm)  # fewer tokens: a rank-deficient fit (results.md)
        report.recovery = cal.fits
        for name, fit in cal.fits.items():
            for note in fit.get("notes", []):
                (self.warn or self.log)(f"{name} ({fit.get('method', name)}) {note}")

    # ---------------------------------------------------------------- evaluate
    @property
    def views(self) -> list[str]:
        """The views evaluation scores: `evaluation.views` (each one of this run's views), or all of them."""
        available, wanted = self.pruned.views if self.pruned is not None else [], self.cfg.evaluation.views
        unknown = [v for v in wanted if v not in available]
        if unknown:
            raise ValueError(f"evaluation.views {unknown} are not views of this run; available: {available}")
        return [v for v in available if v in (wanted or available)]

    def start_evaluation(self, device=None) -> None:
        self.begin("evaluate")
        sources = [s.label for s in self.data.eval_sources]
        self.tally = ViewTally(self.views, sources, reference=DENSE).to(device or model_device(self.llm))

    def score_batch(self, batch: dict[str, torch.Tensor], source: int = 0) -> None:
        """Score one batch; a block-by-block executor's batches wait for one pass over all of them
        (`score_batches`), run by `finish_evaluation`, which updates the tally in the same order."""
        # Windows added only to even out the ranks' shares are run but not counted (`EvenShares`).
        self._pending.append((batch, source))
        if not self.executor.blockwise:
            self._score_pending()

    def _score_pending(self) -> None:
        pending, self._pending = self._pending, []
        for source in dict.fromkeys(s for _, s in pending):
            batches, chunk = [b for b, s in pending if s == source], self.cfg.evaluation.logit_chunk
            for scores in score_batches(self.pruned, batches, self.tally.views, chunk=chunk):
                for view in self.tally.views:
                    self.tally.update(view, source, scores[view])

    def finish_evaluation(self) -> None:
        self._score_pending()
        # `compute` adds the ranks' sums (torchmetrics' all-reduce, `dist_reduce_fx="sum"`) before the means.
        methods = {view: self.cfg.method_of(view) for view in self.tally.views}
        self.report.views = view_results(self.tally, self.pruned, methods)
        self.report.timings["evaluation_s"] = round(time.perf_counter() - self._since["evaluate"], 2)
        self.end("evaluate")

    def evaluate(self) -> None:
        """Every view on every evaluation source in this process (what the Lightning test loop does)."""
        with self.phase("evaluate"):
            windows = {s.label: self.data.eval_windows(s) for s in self.data.eval_sources}
            methods = {view: self.cfg.method_of(view) for view in self.views}
            chunk, size = self.cfg.evaluation.logit_chunk, self.cfg.data.batch_size
            self.report.views = evaluate(self.pruned, self.views, windows, size, chunk=chunk, methods=methods)

    # ------------------------------------------------------ zero-shot, analyse
    def zeroshot(self, step: int = 0) -> None:
        """lm-eval accuracy of every evaluated view (when enabled), resumable under `<run>/zeroshot`."""
        cfg, report, zs = self.cfg, self.report, self.cfg.evaluation.zeroshot
        if not zs.enabled:
            return
        with self.phase("zeroshot"), report.timed("zeroshot"):
            # The flat settings: saved scores of runs made before each method had its own keys stay valid.
            recovery = {r.name: flat_settings(r) for r in cfg.recovery}
            model = model_key(cfg.model)
            digests = view_digests(self.pruned, self.views, model, recovery, self.key, step, self.students)
            store = ScoreStore(self.run_dir / "zeroshot" if self.run_dir else None, write=self.write)
            scores = zeroshot(self.pruned, self.tokenizer, self.views, zs, digests=digests, store=store, log=self.log)
            for view, s in scores.items():
                report.views[view] = replace(report.views[view], zeroshot=s)
            report.zeroshot = {"tasks": list(zs.tasks), "data_dir": zs.data_dir, "limit": zs.limit}

    def analyse(self) -> None:
        """Operator anatomy and held-out alignment (when `evaluation.analysis`; rank 0 only, or every rank
        alike when the model is sharded)."""
        if not (self.cfg.evaluation.analysis and (self.write or self.sharded)):
            return
        with self.phase("analyse"), self.report.timed("analysis"):
            first = next((s for s in self.data.eval_sources if s.chat is None), None)
            if first is None:
                return  # the alignment error reads text windows; a chat source's are padded answers
            windows = self.data.eval_ids(first)[: self.cfg.evaluation.analysis_windows]
            calibration, size = self.data.calibration_ids(), self.cfg.data.batch_size
            self.report.analysis = analysis(self.pruned, windows, calibration, size, first.label)

    def finish(self, step: int = 0) -> None:
        """The phases after evaluation, in order: zero-shot, the analyses, the report."""
        self.zeroshot(step)
        self.analyse()
        self.write_report()

    # ---------------------------------------------------------- report, export
    def write_report(self) -> list[Path]:
        """results.json, results.md and the plots in the run folder (rank 0); the table on the console."""
        with self.phase("report"):
            self.report.evaluation = self.data.summary()
            check_scored(self.report.to_dict())
            if not self.write or self.run_dir is None:
                return []
            paths = write_report(self.run_dir, self.report)
            results = self.report.to_dict()
            warnings = [w for w in (rank_warning(results), *view_warnings(results)) if w]
            self.log("\n" + markdown_table(results) + "\n" + "".join(f"\n{w}\n" for w in warnings))
            self.log("results written to " + ", ".join(str(p) for p in paths))
            return paths

    def export(self, options: ExportOptions | list[str], root: Path, report: dict | None = None) -> list[Path]:
        """`options.views` written under `root` in its formats (`export.options.ExportOptions`; a list of views:
        Hugging Face folders), checked before any work (`check_export`); `report`: the results the exports
        record (default this run's). A sharded model exports on every rank (each block is gathered from all of
        them); rank 0 writes."""
        options = options if isinstance(options, ExportOptions) else ExportOptions(views=list(options))
        report = report if report is not None else self.report.to_dict()
        # The run's calibration windows: a k-quant's importance matrix and compressed-tensors calibrate on them.
        run = {"seed": self.seed, "write": self.write, "calibration": self.data.calibration_ids}
        run["warn"] = self.warn or (lambda message: self.log(f"warning: {message}"))
        with self.phase("export"):
            return export_views(self.pruned, self.tokenizer, report, self.cfg, root, options, **run)
