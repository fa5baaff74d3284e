"""What fine-tuned recovery trains, with which objective and optimiser: the students of a run.

A student is one fine-tuned view: a name (ending in ``_ft``), the recovery entry whose closed form it
starts from, what trains and its recipe. ``distill.methods: [ghost, linearpatch]`` is the shorthand for
one student per method named ``<method>_ft`` with the run-wide recipe (`train`, the learning rates,
`lora`, `loss`); ``distill.students`` adds students with their own recipe, each field left unset taking
the run-wide value. `DistillConfig.specs` resolves both into `Student` records, the only form the
rest of the package reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from ..core.checks import check_unique, repeated
from ..core.settings import cost_only
from ..methods.config import FT_SUFFIX
from .interface import get_part, parts
from .loss import LossConfig


@dataclass
class LoraSettings:
    """LoRA adapters (peft) on the surviving blocks; each fine-tuned method gets its own adapter.

    Args:
        rank: adapter rank r.
        alpha: scaling numerator (the update is alpha/r · B·A).
        dropout: dropout on the adapter's input (the teacher pass has adapters off, so it never sees it).
        target_modules: names of the linear layers inside each block to adapt.
        lr: learning rate of the adapters.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    lr: float = 1e-4


@dataclass
class StudentConfig:
    """One student of `distill.students`; every field left null takes the run-wide `distill` value.

    Args:
        name: its view name; must end in ``_ft`` (e.g. ``ghost_tail_ft``), which no recovery entry may.
        method: the recovery entry whose closed-form fit it starts from.
        train: what trains (see `DistillConfig.train`).
        lr: learning rate of the operators.
        block_lr: learning rate of whole blocks and of the `tail` (head, final norm, blocks).
        norm_lr: learning rate of the norm gains (`norms`).
        tail_blocks: k, the surviving blocks `tail` trains (the last k).
        lora: adapter settings.
        loss: the objective (the hidden-state term included).
        part_options: the options of the parts it trains, by part (`DistillConfig.part_options`).
    """

    name: str = ""
    method: str = ""
    train: list[str] | None = None
    lr: float | None = None
    block_lr: float | None = None
    norm_lr: float | None = None
    tail_blocks: int | None = None
    lora: LoraSettings | None = None
    loss: LossConfig | None = None
    part_options: dict | None = None


@dataclass(frozen=True)
class Student:
    """A resolved student: every field set."""

    name: str
    method: str
    train: tuple[str, ...]
    lr: float
    block_lr: float
    norm_lr: float
    tail_blocks: int
    lora: LoraSettings
    loss: LossConfig
    part_options: dict | None = None

    def trains(self, kind: str) -> bool:
        return kind in self.train


@dataclass
class DistillConfig:
    """Fine-tuned recovery: each method in `methods` gets a view ``<name>_ft`` that starts from that
    method's closed-form fit and is distilled against the dense teacher (`trainer.max_steps` > 0).

    Args:
        methods: recovery names to fine-tune (e.g. ``[ghost, linearpatch]``), one student ``<name>_ft``
            each with the recipe below; every student sees the same batches in the same order.
        students: further students, each with its own name, method and recipe (`StudentConfig`).
        train: what trains, of the registered parts (`distill.parts`): ``operators`` (the gap operators,
            first-position shift included; the default), ``lora`` (adapters on the surviving blocks), ``blocks``
            (the surviving blocks next to each gap), ``tail`` (the output head, the final norm and the last
            `tail_blocks` surviving blocks) and/or ``norms`` (the norm gains of the surviving blocks); what a
            student trains besides operators and adapters is its own copy, so the teacher and the other students
            keep the originals.
        lr: learning rate of the operators.
        block_lr: learning rate of whole blocks and of the tail.
        norm_lr: learning rate of the norm gains.
        tail_blocks: how many of the last surviving blocks `tail` trains.
        weight_decay: AdamW weight decay (operators are stored as M = W − I, so decay pulls W to I).
        betas: AdamW betas.
        warmup_steps: linear warm-up from 0 to the learning rate.
        min_lr_ratio: the cosine schedule ends at lr · min_lr_ratio (LinearPatch: 1/20).
        lora: adapter settings (with ``lora`` in `train`).
        loss: the distillation objective.
        val_every: optimizer steps between validations (0: at the start and the end only).
        keep: which weights the fine-tuned views end with: the ``best`` step by validation KL (per
            method) or the ``last`` step; the report says which.
        checkpoint_every: optimizer steps between resumable checkpoints (`<run>/checkpoints/last.ckpt`).
        share_prefix: when nothing before the first gap trains, run the blocks before it once per
            batch (in the teacher pass) and start every student from there.
        teacher_topk: k: the teacher's top-k log-probabilities and tail mass per training window, computed
            once and cached (`$GHOSTDISTILL_CACHE/teacher_topk`) for every student and later run of the same
            model instead of a teacher pass per step (`distill/teacher_cache.py`); null = the live teacher, all tokens.
        precision: the students' forward: ``fp32``; ``bf16`` (autocast; parameters, optimizer state and
            the loss's sums stay float32); ``auto``: bf16 where the device computes it natively (a CUDA GPU
            with bfloat16, a CPU with AVX-512 BF16 or AMX that ATen and oneDNN may use), else fp32. The
            teacher, evaluation and validation run in the model's dtype either way.
        curve_tokens: training tokens per student (windows × seq_len) at which every student is scored on
            the first evaluation source during training: a budget curve from one run (results.json
            ``distill.curve``, curve.png).
        part_options: the options of a part that declares them (`Part.options`, a dataclass a part of your
            own declares), by part name: ``{final_norm: {scale: 0.5}}``; checked against its fields, for
            every student that trains the part (a student's own `part_options` replaces these).
    """

    methods: list[str] = field(default_factory=list)
    students: list[StudentConfig] = field(default_factory=list)
    train: list[str] = field(default_factory=lambda: ["operators"])
    lr: float = 1e-4
    block_lr: float = 1e-5
    norm_lr: float = 1e-4
    tail_blocks: int = 3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.05
    lora: LoraSettings = field(default_factory=LoraSettings)
    loss: LossConfig = field(default_factory=LossConfig)
    val_every: int = 0
    keep: Literal["best", "last"] = "best"
    checkpoint_every: int = cost_only(50)
    share_prefix: bool = True
    teacher_topk: int | None = None
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    curve_tokens: list[int] = field(default_factory=list)
    part_options: dict | None = None

    def run_wide(self, name: str, method: str) -> Student:
        """A student named `name` from `method` with the run-wide recipe."""
        recipe = {f.name: getattr(self, f.name) for f in fields(Student) if f.name not in ("name", "method")}
        return Student(name, method, **{**recipe, "train": tuple(self.train)})

    def specs(self) -> list[Student]:
        """Every student, resolved: the `methods` shorthand first, then `students`, in order (a student's
        unset keys take the run-wide values; its `lora` and `loss` are its own copies)."""
        out = [self.run_wide(ft_view(m), m) for m in self.methods]
        for s in self.students:
            base = self.run_wide(s.name, s.method)
            keys = ("lr", "block_lr", "norm_lr", "tail_blocks", "part_options")
            own = {k: getattr(s, k) for k in keys if getattr(s, k) is not None}
            if s.train is not None:
                own["train"] = tuple(s.train)
            own["lora"] = copy.deepcopy(self.lora if s.lora is None else s.lora)
            own["loss"] = replace(self.loss if s.loss is None else s.loss)
            out.append(replace(base, **own))
        return out

    def recipe(self, view: str) -> Student:
        """The resolved student named `view`; for a name that is no student, the run-wide recipe under it."""
        return next((s for s in self.specs() if s.name == view), None) or self.run_wide(view, view)

    def views(self) -> list[str]:
        """The fine-tuned views, in the order of `specs`."""
        return [s.name for s in self.specs()]

    def method_of(self, view: str) -> str | None:
        """The recovery entry a fine-tuned view starts from (None: not a student)."""
        return next((s.method for s in self.specs() if s.name == view), None)

    def validate(self, recovery_names: list[str]) -> None:
        unknown = [m for m in self.methods if m not in recovery_names]
        if unknown:
            raise ValueError(
                f"distill.methods {unknown} are not recovery names of this run; available: {recovery_names}"
            )
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"distill.methods lists a method twice: {self.methods}")
        # `validate_recovery` already rejects recovery names ending in `_ft`; this guards the views themselves.
        clash = [ft_view(m) for m in self.methods if ft_view(m) in recovery_names]
        if clash:
            raise ValueError(
                f"distill.methods would make views {clash}, which are recovery names of this run; names ending "
                "in '_ft' are reserved for the fine-tuned views: rename those recovery entries"
            )
        for i, s in enumerate(self.students):
            where = f"distill.students[{i}]"
            if not s.name.endswith(FT_SUFFIX) or s.name == FT_SUFFIX:
                raise ValueError(
                    f"{where}.name {s.name!r} must end in {FT_SUFFIX!r} (fine-tuned views are named so, e.g. "
                    f"'{s.method or 'ghost'}_tail_ft')"
                )
            if s.method not in recovery_names:
                raise ValueError(
                    f"{where}.method {s.method!r} is not a recovery name of this run; available: {recovery_names}"
                )
        twice = sorted(repeated(self.views()))
        if twice:
            raise ValueError(
                f"distill: students {twice} are named twice (distill.methods makes '<method>_ft'); give each "
                "student its own name"
            )
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.val_every < 0 or self.checkpoint_every < 0:
            raise ValueError(
                "distill.weight_decay, warmup_steps, val_every and checkpoint_every must be >= 0; got "
                f"{self.weight_decay}, {self.warmup_steps}, {self.val_every}, {self.checkpoint_every}"
            )
        if self.teacher_topk is not None and (isinstance(self.teacher_topk, bool) or self.teacher_topk < 1):
            raise ValueError(
                f"distill.teacher_topk must be >= 1 (e.g. 64) or null (the live teacher), got {self.teacher_topk}"
            )
        if self.precision not in ("fp32", "bf16", "auto"):
            raise ValueError(f"distill.precision {self.precision!r} is not known; choose fp32, bf16 or auto")
        curve = self.curve_tokens
        if any(isinstance(t, bool) or t < 1 for t in curve) or curve != sorted(curve):
            raise ValueError(
                f"distill.curve_tokens {curve} must be increasing token counts >= 1 (e.g. [82000, 300000])"
            )
        check_unique("distill.curve_tokens", curve)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"distill.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.keep not in ("best", "last"):
            raise ValueError(f"distill.keep {self.keep!r} is not known; choose best or last")
        bad = [t for t in self.train if t not in parts()]
        if bad or not self.train:
            raise ValueError(f"distill.train {self.train} must be a non-empty subset of {list(parts())}")
        for s in self.specs():
            self._validate_student(s)

    def _validate_student(self, s: Student) -> None:
        known = parts()
        where = f"distill (student {s.name})"
        bad = [t for t in s.train if t not in known]
        if bad or not s.train:
            raise ValueError(f"{where}: train {list(s.train)} must be a non-empty subset of {list(known)}")
        if len(set(s.train)) != len(s.train):
            raise ValueError(f"{where}: train {list(s.train)} lists a kind twice")
        whole = [t for t in s.train if get_part(t).adapts_blocks]
        if len(whole) > 1:
            raise ValueError(
                f"{where}: train {whole} adapt the same blocks (lora adapts them, blocks and tail train copies "
                "of them); choose one of them"
            )
        for key, value in {get_part(t).lr_key: get_part(t).lr(s) for t in known}.items():
            if not value > 0:
                raise ValueError(f"{where}: {key} must be > 0, got {value}")
        if s.tail_blocks < 0:
            raise ValueError(f"{where}: tail_blocks must be >= 0 (the last k surviving blocks), got {s.tail_blocks}")
        if s.lora.rank < 1 or not s.lora.alpha > 0 or not 0 <= s.lora.dropout < 1 or not s.lora.target_modules:
            raise ValueError(
                f"{where}: lora needs rank >= 1, alpha > 0, 0 <= dropout < 1 and some target_modules; got {s.lora}"
            )
        check_unique(f"{where}: lora.target_modules", s.lora.target_modules)
        s.loss.validate()
        for name in s.part_options or {}:
            if name not in s.train:
                raise ValueError(
                    f"{where}: part_options names {name!r}, which it does not train (train: {list(s.train)})"
                )
            get_part(name).options_of(s)


def ft_view(method: str) -> str:
    """The fine-tuned view of a recovery method in the `methods` shorthand."""
    return f"{method}{FT_SUFFIX}"
