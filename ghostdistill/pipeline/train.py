"""Fine-tuned recovery: build the students, one distillation step, validation.

    students = build_students(pruned, cfg, batch)         every student from its method's closed form
    losses = distill_step(students, batch)                one teacher pass (or its cached top-k), every student
    entry = validate(students, windows, ...)                  KL and perplexity per student on held-out windows
    tracker.record(entry, students)                           each student's best step, by validation KL

`DistillPhases` is the run's side of them (`pipeline.run.Run` holds the state); the Lightning module calls those
from its hooks, and a script can call the functions in its own loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from ..core.head import output_head
from ..core.model import model_key
from ..core.offload import is_offloaded, model_device, offload_mode
from ..core.views import PrunedModel
from ..distill.cached_loss import fusable, fused_cached_loss
from ..distill.config import DistillConfig
from ..distill.loss import chunked_cached_loss, chunked_distillation_loss, hidden_positions, hidden_state_loss
from ..distill.parallel import full_tensor
from ..distill.students import Students, native_bf16
from ..distill.teacher_cache import TeacherCache
from ..evaluation.metrics import next_token_targets
from .calibrate import Batch, Dist
from .config import students_offloaded
from .evaluate import score_views


def build_students(
    pruned: PrunedModel,
    cfg: DistillConfig,
    check_batch: Batch | None = None,
    methods: Mapping[str, str] | None = None,
    model_key: dict | None = None,
    write: bool = True,
) -> Students:
    """The fine-tuned views (`DistillConfig.specs`), each starting from its method's fitted view; everything
    else frozen. With `check_batch`, the shared-prefix shortcut is verified against a full student forward
    on it. `methods`: the registered method of each recovery name (where a name is not one), which decides
    how a student trains its operators (`Students`). `model_key`: the model's settings, which key the
    teacher's cached top-k (`distill.teacher_topk`; `write`: this process writes its files). Refused for a
    model whose weights are offloaded."""
    if is_offloaded(pruned.model):
        raise ValueError(students_offloaded(offload_mode(pruned.model)))
    students = Students(pruned, cfg, methods)
    students.build()
    temperatures = {s.loss.temperature for s in students.specs.values()}
    if cfg.teacher_topk is not None:
        if len(temperatures) > 1:
            raise ValueError(
                f"distill.teacher_topk caches the teacher at one temperature; the students' loss.temperature are "
                f"{sorted(temperatures)}: give them one, or set distill.teacher_topk: null"
            )
        vocab = output_head(pruned.model).weight.shape[0]
        key = model_key if model_key is not None else {"model": type(pruned.model).__name__}
        students.cache = TeacherCache(key, cfg.teacher_topk, temperatures.pop(), vocab, write=write)
    device = next(pruned.model.parameters()).device
    students.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and native_bf16(device))
    if check_batch is not None:
        students.check_prefix(check_batch)
    return students


def describe(students: Students) -> str:
    """What trains, and how: the line a run logs once its students are built."""
    st = students
    return (
        "distilling "
        + ", ".join(f"{v} ({'+'.join(s.train)})" for v, s in st.specs.items())
        + f"; blocks before the first gap run {'once, shared' if st.share_prefix else 'for every student'}"
        + f"; students {'under bfloat16 autocast' if st.bf16 else 'in the model dtype'}"
        + (f"; teacher: top-{st.cache.k} cached in {st.cache.folder}" if st.cache else "; teacher: run every step")
    )


def distill_step(students: Students, batch: Batch) -> dict[str, torch.Tensor]:
    """Each student's loss on one batch against one teacher pass, with its own objective (`Student.loss`):
    the logit loss, plus `hidden_weight` × the hidden-state term where set. Sum them for the backward:
    students share no parameter, so the gradient of the sum is each student's own gradient."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    targets, valid = next_token_targets(ids, mask)
    teacher_head = output_head(students.pruned.model)
    cache, topk, teacher = students.cache, None, None
    if cache is not None:
        topk = cache.lookup(ids, mask)
        if topk is None:  # the teacher's first pass over these windows, in the model's dtype
            teacher = students.teacher(batch)
            topk = cache.store(ids, mask, teacher.hidden, teacher_head, students.cfg.loss.chunk_tokens)
        # The students' input (the blocks before their start) in their own precision, whether the windows were
        # cached or not, so that a step computes the same either way; a hidden-state target stays exact.
        low = students.bf16 and not any(s.loss.hidden_weight > 0 for s in students.specs.values())
        if teacher is None or low:
            with students.autocast() if low else nullcontext():
                teacher = students.teacher(batch, logits=False)
    else:
        teacher = students.teacher(batch)
    losses = {}
    for view in students.views:
        loss = students.specs[view].loss
        with students.autocast():
            out = students.student(view, batch, teacher)
            head = students.head(view)
            if topk is not None:
                cached = fused_cached_loss if fusable(loss, head) else chunked_cached_loss
                total = cached(out.hidden[:, :-1], head, valid, targets, topk, loss)
            else:
                total = chunked_distillation_loss(
                    out.hidden[:, :-1], teacher.hidden[:, :-1], head, valid, targets, loss, teacher_head=teacher_head
                )
        if loss.hidden_weight > 0:
            where = hidden_positions(mask, loss.hidden_first)
            total = total + loss.hidden_weight * hidden_state_loss(
                out.streams, teacher.streams, where, loss.hidden_kind, loss.chunk_tokens
            )
        losses[view] = total
    return losses


@torch.no_grad()
def validate(
    students: Students,
    windows: torch.Tensor,
    batch_size: int,
    step: int,
    *,
    chunk: int | None = None,
    dist: Dist = Dist(),
    sync_check: Callable[[list[torch.Tensor]], bool] | None = None,
) -> dict:
    """KL to the teacher and perplexity of every student on `windows` (each rank scores its share, the sums
    are reduced); returns the history entry `{"step", <view>: {"kl", "ppl"}}`. With `sync_check`, it is
    also checked that every rank holds the same students (a desync is a bug, not noise)."""
    views = students.views
    # The same number of batches on every rank (sharded models run collectives in every forward).
    ids = windows[: len(windows) // dist.world * dist.world] if dist.world > 1 else windows
    device = model_device(students.pruned.model)
    sums = torch.zeros(len(views), 3, dtype=torch.float64, device=device)  # nll, kl, tokens
    mine = ids[dist.rank :: dist.world]
    for lo in range(0, len(mine), batch_size):
        part = mine[lo : lo + batch_size].to(device)
        scores = score_views(students.pruned, part, torch.ones_like(part), views, chunk=chunk)
        for k, view in enumerate(views):
            sums[k, 0] += scores[view].nll.double().sum()
            sums[k, 1] += scores[view].kl.double().sum()
            sums[k, 2] += scores[view].nll.numel()
    if dist.world > 1:
        sums = dist.reduce(sums.clone())
    entry: dict = {"step": step}
    if sync_check is not None:
        entry["ranks_in_sync"] = sync_check([p for v in views for p in students.params[v].all()])
        if not entry["ranks_in_sync"]:
            raise RuntimeError(
                f"the students differ between ranks at step {step}: distributed training went out of sync"
            )
    for k, view in enumerate(views):
        nll, kl, tokens = (float(x) for x in sums[k])
        entry[view] = {"kl": kl / tokens, "ppl": float(torch.exp(torch.tensor(nll / tokens)))}
    return entry


@dataclass
class BestSteps:
    """The validation history, each student's best step by KL (with its trainable values by name) and the
    budget curve's points."""

    history: list[dict] = field(default_factory=list)
    best: dict[str, dict] = field(default_factory=dict)
    curve: list[dict] = field(default_factory=list)

    def record(self, entry: dict, students: Students) -> None:
        self.history.append(entry)
        for view in students.views:
            kl = entry[view]["kl"]
            if view not in self.best or kl < self.best[view]["kl"]:
                self.best[view] = {"step": entry["step"], "kl": kl, "state": students.trainable_state(view)}

    def restore(self, students: Students, keep: str, step: int) -> None:
        """With `keep: best`, put each student back at its best validation step."""
        if keep != "best":
            return
        for view in students.views:
            best = self.best.get(view)
            if best is not None and best["step"] != step:
                students.load_trainable_state(view, best["state"])

    def summary(self, cfg: DistillConfig, steps: int, share_prefix: bool, students: Students | None = None) -> dict:
        """The report's `distill` section: the settings, every student resolved (with its trainable
        parameters when `students` is given), the history and each student's best step."""
        specs = {s.name: asdict(s) for s in cfg.specs()}
        if students is not None:
            for view, params in students.params.items():
                specs[view]["trainable_params"] = sum(p.numel() for p in params.all())
        return {
            **asdict(cfg),
            "resolved": specs,
            "steps": steps,
            "kept": cfg.keep,
            "prefix_shared": share_prefix,
            "best": {v: {"step": b["step"], "val_kl": b["kl"]} for v, b in self.best.items()},
            "history": self.history,
            **({"curve": self.curve} if self.curve else {}),
        }


def checkpoint_extras(tracker: BestSteps, students: Students, last_validated: int | None) -> dict:
    """What a distillation checkpoint holds beside Lightning's state: every student's trainable values by name,
    the validation history and each student's best step, as whole tensors (sharded ones gathered) and plain
    data, so the file loads with `weights_only=True`."""
    best = {v: {**b, "state": {k: full_tensor(t) for k, t in b["state"].items()}} for v, b in tracker.best.items()}
    trained = {v: {k: full_tensor(t) for k, t in students.trainable_state(v).items()} for v in students.views}
    extras = {"history": tracker.history, "best": best, "students": trained, "last_validated": last_validated}
    return {**extras, "curve": tracker.curve}


def check_checkpoint_keys(saved: set[str], trainable: set[str]) -> None:
    """A checkpoint resumes only a run with exactly its trainable tensors (same distill settings and plan)."""
    if saved != trainable:
        raise ValueError(
            f"the checkpoint does not hold this run's students: {len(saved - trainable)} tensors it has are not "
            f"trainable here and {len(trainable - saved)} trainable tensors are missing from it (e.g. "
            f"{sorted(saved ^ trainable)[:3]}); resume with the same model.distill and plan"
        )


class DistillPhases:
    """The distillation phases of a `pipeline.run.Run` (its state: `cfg`, `pruned`, `data`, `students`, `tracker`,
    `report`; its `phase` timer and `log`), in the order the loop calls them: `build_students` once (from
    `Run.prepare`), then per step `distill_step` (the loop times each step as the phase ``step``), with `validate`
    and `curve` when due, and `end_distillation` after the last step."""

    def build_students(self, check: bool = True):
        """The students, each from its method's closed form (before any optimizer exists)."""
        with self.phase("distil"):
            methods = self.cfg.methods()
            check_batch, key = self._batches[0] if check else None, model_key(self.cfg.model)
            self.students = build_students(self.pruned, self.cfg.distill, check_batch, methods, key)
        self.log(describe(self.students))
        return self.students

    def distill_step(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return distill_step(self.students, batch)

    def validate(self, step: int, *, dist: Dist = Dist(), sync_check=None) -> dict | None:
        """Validate the students at `step` (once per step; None without validation windows)."""
        windows = self.data.val_ids()
        if self.last_validated == step or windows is None:
            return None
        with self.phase("validate"):
            chunk, size = self.cfg.evaluation.logit_chunk, self.cfg.data.batch_size
            entry = validate(self.students, windows, size, step, chunk=chunk, dist=dist, sync_check=sync_check)
        self.tracker.record(entry, self.students)
        self.last_validated = step  # after the record: a validation cut short by a signal runs again on resume
        line = ", ".join(f"{v} KL {entry[v]['kl']:.4f} PPL {entry[v]['ppl']:.2f}" for v in self.students.views)
        self.log(f"validation at step {step}: {line}")
        return entry

    def curve(self, step: int, batches_per_step: int = 1, dist: Dist = Dist()) -> None:
        """The budget curve's points due after `step` optimizer steps of `batches_per_step` batches (ranks ×
        accumulation): once the training tokens per student (windows × seq_len of every batch of a step) reach
        counts of `distill.curve_tokens` no point stands for yet, every student's KL to the teacher and
        perplexity on the first text evaluation source, as they stand, appended to `tracker.curve`."""
        cfg, data, curve = self.cfg, self.data, self.tracker.curve
        with self.phase("curve"):
            tokens = step * batches_per_step * cfg.data.batch_size * data.train_ids().shape[1]
            done = {b for point in curve for b in point["budgets"]}
            due = [b for b in cfg.distill.curve_tokens if b <= tokens and b not in done]
            if not due:
                return
            source = next((s for s in data.eval_sources if s.chat is None), None)
            if source is None:
                raise ValueError(
                    "distill.curve_tokens scores the students on a text evaluation source; this run has none"
                )
            chunk, size = cfg.evaluation.logit_chunk, cfg.data.batch_size
            entry = validate(self.students, data.eval_ids(source), size, step, chunk=chunk, dist=dist)
            curve.append({"tokens": tokens, "budgets": due, "source": source.label, **entry})
        line = ", ".join(f"{v} PPL {curve[-1][v]['ppl']:.2f}" for v in self.students.views)
        self.log(f"budget curve at {tokens:,} tokens: {line}")

    def end_distillation(self, step: int) -> None:
        self.tracker.restore(self.students, self.cfg.distill.keep, step)
        self.report.distill = self.tracker.summary(self.cfg.distill, step, self.students.share_prefix, self.students)
