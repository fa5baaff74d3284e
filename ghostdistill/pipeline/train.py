"""Fine-tuned recovery: build the students, one distillation step, validation.

    students = build_students(pruned, cfg, batch)         every student from its method's closed form
    losses = distill_step(students, batch)                one teacher pass, every student on the same batch
    entry = validate(students, windows, ...)                  KL and perplexity per student on held-out windows
    tracker.record(entry, students)                           each student's best step, by validation KL

The Lightning module calls these from its hooks; a script can call them in its own loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from ..core.head import output_head
from ..core.offload import is_offloaded, model_device, offload_mode
from ..core.views import PrunedModel
from ..distill.config import DistillConfig
from ..distill.loss import chunked_distillation_loss, hidden_positions, hidden_state_loss
from ..distill.parallel import full_tensor
from ..distill.students import Students
from ..evaluation.metrics import next_token_targets
from .calibrate import Batch, Dist
from .evaluate import score_views


def students_offloaded(offload: str) -> str:
    """Why distillation does not run with offloaded weights, and what to do instead (one line)."""
    return (
        f"model.model.offload {offload} keeps the weights off the device, and the students train on a device that "
        "holds the model: shard it over several devices with trainer.strategy FSDP2 and model.model.offload none "
        "(docs/distillation.md), or set trainer.max_steps 0"
    )


def build_students(
    pruned: PrunedModel,
    cfg: DistillConfig,
    check_batch: Batch | None = None,
    methods: Mapping[str, str] | None = None,
) -> Students:
    """The fine-tuned views (`DistillConfig.specs`), each starting from its method's fitted view; everything
    else frozen. With `check_batch`, the shared-prefix shortcut is verified against a full student forward
    on it. `methods`: the registered method of each recovery name (where a name is not one), which decides
    how a student trains its operators (`Students`). Refused for a model whose weights are offloaded."""
    if is_offloaded(pruned.model):
        raise ValueError(students_offloaded(offload_mode(pruned.model)))
    students = Students(pruned, cfg, methods)
    students.build()
    if check_batch is not None:
        students.check_prefix(check_batch)
    return students


def distill_step(students: Students, batch: Batch) -> dict[str, torch.Tensor]:
    """Each student's loss on one batch against one teacher pass, with its own objective (`Student.loss`):
    the logit loss, plus `hidden_weight` × the hidden-state term where set. Sum them for the backward:
    students share no parameter, so the gradient of the sum is each student's own gradient."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    targets, valid = next_token_targets(ids, mask)
    teacher_head = output_head(students.pruned.model)
    teacher = students.teacher(batch)
    losses = {}
    for view in students.views:
        loss = students.specs[view].loss
        out = students.student(view, batch, teacher)
        head = students.head(view)
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
    """The validation history and each student's best step by KL, with its trainable values by name."""

    history: list[dict] = field(default_factory=list)
    best: dict[str, dict] = field(default_factory=dict)

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
        }


def checkpoint_extras(tracker: BestSteps, students: Students, last_validated: int | None) -> dict:
    """What a distillation checkpoint holds beside Lightning's state: every student's trainable values by name,
    the validation history and each student's best step, as whole tensors (sharded ones gathered) and plain
    data, so the file loads with `weights_only=True`."""
    best = {v: {**b, "state": {k: full_tensor(t) for k, t in b["state"].items()}} for v, b in tracker.best.items()}
    trained = {v: {k: full_tensor(t) for k, t in students.trainable_state(v).items()} for v in students.views}
    return {"history": tracker.history, "best": best, "students": trained, "last_validated": last_validated}


def check_checkpoint_keys(saved: set[str], trainable: set[str]) -> None:
    """A checkpoint resumes only a run with exactly its trainable tensors (same distill settings and plan)."""
    if saved != trainable:
        raise ValueError(
            f"the checkpoint does not hold this run's students: {len(saved - trainable)} tensors it has are not "
            f"trainable here and {len(trainable - saved)} trainable tensors are missing from it (e.g. "
            f"{sorted(saved ^ trainable)[:3]}); resume with the same model.distill and plan"
        )
