"""What fine-tuned recovery trains, with which objective and optimiser."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .loss import LossConfig

Trainable = Literal["operators", "lora", "blocks"]


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
class DistillConfig:
    """Fine-tuned recovery: each method in `methods` gets a view ``<name>_ft`` that starts from that
    method's closed-form fit and is distilled against the dense teacher (`trainer.max_steps` > 0).

    Args:
        methods: recovery names to fine-tune (e.g. ``[ghost, linearpatch]``); every one sees the same
            batches in the same order with the same recipe, trained in the same step.
        train: what trains: ``operators`` (the gap operators, first-position shift included; the
            default), ``lora`` (adapters on the surviving blocks) and/or ``blocks`` (the surviving
            blocks next to each gap, as per-method copies; the teacher keeps the originals).
        lr: learning rate of the operators.
        block_lr: learning rate of whole blocks.
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
    """

    methods: list[str] = field(default_factory=list)
    train: list[Trainable] = field(default_factory=lambda: ["operators"])
    lr: float = 1e-4
    block_lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.05
    lora: LoraSettings = field(default_factory=LoraSettings)
    loss: LossConfig = field(default_factory=LossConfig)
    val_every: int = 0
    keep: Literal["best", "last"] = "best"
    checkpoint_every: int = 50
    share_prefix: bool = True

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
        bad = [t for t in self.train if t not in ("operators", "lora", "blocks")]
        if bad or not self.train:
            raise ValueError(
                f"distill.train {self.train} must be a non-empty subset of ['operators', 'lora', 'blocks']"
            )
        if "lora" in self.train and "blocks" in self.train:
            raise ValueError("distill.train: 'lora' and 'blocks' adapt the same blocks; choose one of them")
        for name, value in (("lr", self.lr), ("block_lr", self.block_lr), ("lora.lr", self.lora.lr)):
            if not value > 0:
                raise ValueError(f"distill.{name} must be > 0, got {value}")
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.val_every < 0 or self.checkpoint_every < 0:
            raise ValueError(
                "distill.weight_decay, warmup_steps, val_every and checkpoint_every must be >= 0; got "
                f"{self.weight_decay}, {self.warmup_steps}, {self.val_every}, {self.checkpoint_every}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"distill.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.keep not in ("best", "last"):
            raise ValueError(f"distill.keep {self.keep!r} is not known; choose best or last")
        if (
            self.lora.rank < 1
            or not self.lora.alpha > 0
            or not 0 <= self.lora.dropout < 1
            or not self.lora.target_modules
        ):
            raise ValueError(
                f"distill.lora: rank >= 1, alpha > 0, 0 <= dropout < 1 and some target_modules needed; got {self.lora}"
            )
        self.loss.validate()


def ft_view(method: str) -> str:
    """The fine-tuned view of a recovery method."""
    return f"{method}_ft"
