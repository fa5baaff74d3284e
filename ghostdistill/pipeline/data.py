"""The windows a run reads: calibration, distillation training and validation, and evaluation.

`RunData` turns the data settings into token windows, each computed once: it needs the tokenizer and,
for self-generated (data-free) text, the dense model that writes it. Nothing here knows about
Lightning; the data module hands these windows to its loaders.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..core.io import atomic_torch_save, json_digest
from ..data import (
    GENERATE,
    TextSource,
    calibration_windows,
    evaluation_windows,
    generate_windows,
    shared_ngrams,
    validate_source,
)


@dataclass
class CalibrationData:
    """Calibration text: `num_samples` windows of `seq_len` tokens, deterministic for `seed`.

    With ``source: generate`` the dense model writes them itself (data-free); the tokens are cached in
    the run folder so a resumed run does not sample again.
    """

    source: TextSource = field(default_factory=lambda: TextSource(source="c4"))
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0


@dataclass
class EvaluationData:
    """Held-out text for perplexity and teacher fidelity (KL, top-1 agreement), windows of `seq_len`.

    `max_windows` keeps only the first windows of each source (for quick runs; results say so).
    """

    sources: list[TextSource] = field(default_factory=lambda: [TextSource(source="wikitext2")])
    seq_len: int = 2048
    max_windows: int | None = None


@dataclass
class TrainData:
    """Distillation training windows: random windows (as calibration draws them), deterministic for
    `seed`. `source: null` trains on the calibration windows themselves (LinearPatch's recipe).
    Windows never overlap an evaluation window cut from the same text (checked; the run stops)."""

    source: TextSource | None = None
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0


@dataclass
class ValidationData:
    """Held-out windows that validation during distillation reads (KL to the teacher and perplexity
    per method): the first `num_windows` non-overlapping windows of `source`, which must not overlap
    the evaluation windows. `source: null` validates on nothing (only the final evaluation)."""

    source: TextSource | None = None
    num_windows: int = 8
    seq_len: int = 2048


@dataclass
class SelectionData:
    """Held-out windows on which the repair-aware plan criteria (`plan.criterion` ``repair``,
    ``repair_greedy``) score every repaired candidate: the first `num_windows` non-overlapping windows of
    `source`, which must share no text with the calibration or evaluation windows (checked; the run stops).
    `source: null` with self-generated calibration text generates further windows with another seed; with
    a text source it is an error naming the fix (take later documents of the same text).

    Read only by those criteria."""

    source: TextSource | None = None
    num_windows: int = 8
    seq_len: int = 512


@dataclass
class DataConfig:
    """All of a run's data settings (the data module's arguments)."""

    calibration: CalibrationData = field(default_factory=CalibrationData)
    evaluation: EvaluationData = field(default_factory=EvaluationData)
    train: TrainData = field(default_factory=TrainData)
    validation: ValidationData = field(default_factory=ValidationData)
    batch_size: int = 4
    selection: SelectionData = field(default_factory=SelectionData)

    def validate(self) -> None:
        """What the values alone decide (before any tokenizer or model is loaded)."""
        positive = {
            "calibration.num_samples": self.calibration.num_samples,
            "calibration.seq_len": self.calibration.seq_len,
            "evaluation.seq_len": self.evaluation.seq_len,
            "batch_size": self.batch_size,
            "train.num_samples": self.train.num_samples,
            "train.seq_len": self.train.seq_len,
            "validation.num_windows": self.validation.num_windows,
            "validation.seq_len": self.validation.seq_len,
            "selection.num_windows": self.selection.num_windows,
            "selection.seq_len": self.selection.seq_len,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"data.{name} must be a positive integer, got {value}")
            if value < 2 and name in ("evaluation.seq_len", "validation.seq_len", "selection.seq_len"):
                raise ValueError(f"data.{name} {value}: a scored window must hold at least 2 tokens; use 2 or more")
        if self.evaluation.max_windows is not None and self.evaluation.max_windows < 1:
            raise ValueError(f"data.evaluation.max_windows must be >= 1 or null, got {self.evaluation.max_windows}")
        validate_source(self.calibration.source)
        for src in (*self.evaluation.sources, self.train.source, self.validation.source, self.selection.source):
            if src is not None:
                validate_source(src)
        labels = [s.label for s in self.evaluation.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation sources need distinct names; got {labels} (set `name:` on each)")

    def describe(self) -> dict:
        return {k: asdict(getattr(self, k)) for k in ("calibration", "evaluation", "train", "validation", "selection")}


class RunData:
    """Token windows of one run, each computed on first use and kept.

    Args:
        cfg: the data settings.
        tokenizer: the model's tokenizer.
        run_dir: where self-generated calibration text is cached (None: not cached).
        dense: a context that gives the dense model, for self-generated text (entered only then; bar: `progress`).
        model_key: what identifies the model that generates (its token ids mean nothing to another one).
        write: whether this process writes the cache (rank 0 of several).
    """

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer,
        run_dir: Path | None = None,
        dense: Callable[[], AbstractContextManager[nn.Module]] | None = None,
        model_key: dict | None = None,
        write: bool = True,
        progress: bool | Callable = True,
    ) -> None:
        self.cfg, self.tokenizer, self.run_dir = cfg, tokenizer, run_dir
        self.dense, self.model_key, self.write, self.progress = dense, model_key or {}, write, progress
        self._calibration: torch.Tensor | None = None
        self._eval: dict[str, torch.Tensor] = {}
        self._train: torch.Tensor | None = None
        self._val: torch.Tensor | None = None
        self._val_read = False
        self._selection: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    def _generate(self, seq_len: int, n: int, seed: int) -> torch.Tensor:
        if self.dense is None:
            raise ValueError("source: generate needs the dense model, which this run did not provide")
        with self.dense() as model:
            return generate_windows(model, self.tokenizer, seq_len, n, seed, self.batch_size, progress=self.progress)

    def generated_cache(self) -> Path | None:
        """Where self-generated calibration tokens are kept: keyed by the model that wrote them and the
        calibration settings."""
        if self.run_dir is None:
            return None
        key = json_digest(
            {"model": self.model_key, "calibration": asdict(self.cfg.calibration), "batch_size": self.batch_size}
        )
        return Path(self.run_dir) / f"generated_calibration_{key}.pt"

    def calibration_ids(self) -> torch.Tensor:
        if self._calibration is None:
            cal = self.cfg.calibration
            if cal.source.source == GENERATE:
                cache = self.generated_cache()
                if cache is not None and cache.is_file():
                    ids = torch.load(cache, weights_only=True)
                else:
                    # Seeded: every rank samples the same text; only rank 0 keeps it.
                    ids = self._generate(cal.seq_len, cal.num_samples, cal.seed)
                    if cache is not None and self.write:
                        atomic_torch_save(ids, cache)
            else:
                ids = calibration_windows(self.tokenizer, cal.source, cal.seq_len, cal.num_samples, cal.seed)
            self._calibration = ids
        return self._calibration

    def calibration_batches(self) -> list[dict[str, torch.Tensor]]:
        ids = self.calibration_ids()
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(self.batch_size)]

    def eval_ids(self, src: TextSource) -> torch.Tensor:
        if src.label not in self._eval:
            ev = self.cfg.evaluation
            if src.source == GENERATE:
                # Held-out self-generated text: a seed the calibration does not use.
                ids = self._generate(ev.seq_len, ev.max_windows or 8, 10_000 + self.cfg.calibration.seed)
            else:
                ids = evaluation_windows(self.tokenizer, src, ev.seq_len, ev.max_windows)
            self._eval[src.label] = ids
        return self._eval[src.label]

    def train_ids(self) -> torch.Tensor:
        if self._train is None:
            tr = self.cfg.train
            if tr.source is None:
                ids = self.calibration_ids()
            else:
                ids = calibration_windows(self.tokenizer, tr.source, tr.seq_len, tr.num_samples, tr.seed)
            self._check_disjoint("training", tr.source or self.cfg.calibration.source, ids)
            self._train = ids
        return self._train

    def val_ids(self) -> torch.Tensor | None:
        va = self.cfg.validation
        if not self._val_read and va.source is not None:
            ids = evaluation_windows(self.tokenizer, va.source, va.seq_len, va.num_windows)
            self._check_disjoint("validation", va.source, ids)
            self._val = ids
        self._val_read = True
        return self._val

    def selection_ids(self) -> torch.Tensor:
        """The repair-aware criteria's held-out windows (`SelectionData`)."""
        if self._selection is None:
            sel, cal = self.cfg.selection, self.cfg.calibration
            if sel.source is None:
                if cal.source.source != GENERATE:
                    raise ValueError(
                        "plan.criterion repair / repair_greedy scores candidates on held-out windows: set "
                        "data.selection.source, e.g. the calibration text's later documents "
                        f"({{source: {cal.source.source}, first_document: <after calibration's>}})"
                    )
                # Self-generated: further windows from a seed neither calibration nor evaluation uses.
                ids = self._generate(sel.seq_len, sel.num_windows, 20_000 + cal.seed)
            else:
                ids = evaluation_windows(self.tokenizer, sel.source, sel.seq_len, sel.num_windows)
                self._check_disjoint("selection", sel.source, ids)
                if _same_text(sel.source, cal.source):
                    hits = shared_ngrams(ids, self.calibration_ids())
                    if hits:
                        raise ValueError(
                            f"{len(hits)} selection windows of {sel.source.source!r} overlap the calibration "
                            "windows (the same text): take them from other documents (first_document / "
                            "max_documents) or another source"
                        )
            self._selection = ids
        return self._selection

    def selection_batches(self) -> list[dict[str, torch.Tensor]]:
        ids = self.selection_ids()
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(self.batch_size)]

    def check_before_calibration(self, max_positions: int | None, distilling: bool) -> None:
        """What needs only the tokenizer, before minutes of calibration: every evaluation text (and, when
        distilling, the training and validation text) yields its windows, and a window longer than the
        model's position limit gets a warning."""
        # Lengths of set sources only: a null train source reads the calibration windows; `repair` reads no evaluation.
        cal, ev = self.cfg.calibration, self.cfg.evaluation
        lengths = {"calibration": cal.seq_len, **({"evaluation": ev.seq_len} if ev.sources else {})}
        if distilling and self.cfg.train.source is not None:
            lengths["train"] = self.cfg.train.seq_len
        if distilling and self.cfg.validation.source is not None:
            lengths["validation"] = self.cfg.validation.seq_len
        for what, n in lengths.items():
            if max_positions and n > max_positions:
                warnings.warn(
                    f"data.{what}.seq_len {n} is longer than the model's position limit "
                    f"(max_position_embeddings {max_positions}): positions beyond it were never trained",
                    stacklevel=2,
                )
        for src in self.cfg.evaluation.sources:
            if src.source != GENERATE:
                self.eval_ids(src)
        if distilling:
            self.train_ids()
            self.val_ids()

    def _check_disjoint(self, what: str, src: TextSource, ids: torch.Tensor) -> None:
        """Windows for training or validation must share no 32-token run with an evaluation window of the
        same text (same file or hub data set); a clear error names both and how to separate them."""
        for ev in self.cfg.evaluation.sources:
            if _same_text(src, ev):
                hits = shared_ngrams(ids, self.eval_ids(ev))
                if hits:
                    raise ValueError(
                        f"{len(hits)} {what} windows of {src.source!r} overlap the evaluation windows of "
                        f"{ev.label!r} (the same text): take them from other documents (first_document / "
                        "max_documents) or another source"
                    )

    def summary(self) -> dict:
        """What the evaluation read (and, after distillation, what training and validation read)."""
        ev = self.cfg.evaluation
        summary: dict = {
            "seq_len": ev.seq_len,
            "max_windows": ev.max_windows,
            "sources": {
                s.label: {**s.describe(), "windows": len(self._eval[s.label])}
                for s in ev.sources
                if s.label in self._eval
            },
        }
        if self._train is not None:
            tr = self.cfg.train
            summary["train"] = {
                **asdict(tr),
                "source": asdict(tr.source) if tr.source else "the calibration windows",
                "windows": len(self._train),
                "seq_len": int(self._train.shape[1]),
            }
        if self._val is not None:
            summary["validation"] = {**asdict(self.cfg.validation), "windows": len(self._val)}
        if self._selection is not None:
            sel = self.cfg.selection
            summary["selection"] = {
                **asdict(sel),
                "source": asdict(sel.source) if sel.source else "generated (seed 20000 + calibration.seed)",
                "windows": len(self._selection),
            }
        return summary


def _same_text(a: TextSource, b: TextSource) -> bool:
    """Whether two sources read the same text (a hub data set and split, or the same file)."""
    if a.source == GENERATE or b.source == GENERATE:
        return False
    pa, pb = Path(a.source).expanduser(), Path(b.source).expanduser()
    if pa.is_file() and pb.is_file():
        return pa.resolve() == pb.resolve()
    return a.source == b.source
