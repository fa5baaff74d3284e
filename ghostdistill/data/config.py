"""The data sections of a run's config: calibration, evaluation, distillation training and validation, the
repair-aware plan's selection windows, and `DataConfig` holding them (the data module's arguments).
`data.run.RunData` turns them into token windows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..core.settings import cost_only, is_later, setting
from .sources import GENERATE, TextSource, validate_source

#: How training windows are cut from a text source (`TrainData.cut`): random offsets (None, "random")
#: or consecutive, non-overlapping windows.
DISJOINT = "disjoint"
TRAIN_CUTS = (None, "random", DISJOINT)


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

    `max_windows` keeps only the first windows of each source (for quick runs; results say so); a chat
    source scores every instruction (`max_documents` keeps the first). `chat`: the chat score
    (`data.run_chat`), null: on for a model with a chat template; true: on; false: off.
    """

    sources: list[TextSource] = field(default_factory=lambda: [TextSource(source="wikitext2")])
    seq_len: int = 2048
    max_windows: int | None = None
    chat: bool | None = None


@dataclass
class TrainData:
    """Distillation training windows: random windows (as calibration draws them), deterministic for
    `seed`. `source: null` trains on the calibration windows themselves (LinearPatch's recipe).
    Windows never overlap an evaluation window cut from the same text (checked; the run stops).

    Random windows of short documents overlap (the joined short documents are cut at random offsets), so
    900 windows of 1,000 C4 documents hold far fewer distinct tokens than 900 × `seq_len`. For budgets
    beyond what the text holds:

    - `cut: disjoint`: the first `num_samples` non-overlapping windows of the documents joined in
      order (EOS between them), every token of the text at most once (null: random windows);
      `more_sources`: further text sources cut the same way, in order after `source` (each one's windows its
      own: e.g. the same file's documents after those validation reads);
    - `generated`: this many more windows the dense model writes itself (`source: generate`'s sampling, seed
      30000 + `seed`, `generate_batch` at a time; null: data.batch_size), cached in the run folder.
    """

    source: TextSource | None = None
    num_samples: int = 128
    seq_len: int = 2048
    seed: int = 0
    cut: str | None = setting(None, later=True)
    more_sources: list[TextSource] | None = setting(None, later=True)
    generated: int | None = setting(None, later=True)
    generate_batch: int | None = setting(None, later=True)


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
    # DataLoader workers for evaluation (the data module's `num_workers`): what it costs, not what it computes.
    num_workers: int = cost_only(0)

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
        for name in ("generated", "generate_batch"):
            value = getattr(self.train, name)
            if value is not None and value < 1:
                raise ValueError(f"data.train.{name} must be a positive integer or null, got {value}")
        if self.train.cut not in TRAIN_CUTS:
            raise ValueError(f"data.train.cut {self.train.cut!r}: choose random (or null) or {DISJOINT}")
        if self.train.cut == DISJOINT and (self.train.source is None or self.train.source.source == GENERATE):
            raise ValueError(
                "data.train.cut: disjoint cuts windows of a text source; set data.train.source to a file or a "
                "hub name (the calibration windows and generated text are windows already)"
            )
        if self.train.more_sources and self.train.cut != DISJOINT:
            raise ValueError(
                "data.train.more_sources are cut after data.train.source's windows: set data.train.cut: disjoint"
            )
        for i, src in enumerate(self.train.more_sources or []):
            validate_source(src, f"data.train.more_sources[{i}]")
            if src.chat is not None or src.source == GENERATE:
                raise ValueError(f"data.train.more_sources[{i}]: give a text file or a hub name (plain text)")
        if self.train.generate_batch is not None and not self.train.generated:
            raise ValueError("data.train.generate_batch sizes the generated windows: set data.train.generated too")
        if self.evaluation.max_windows is not None and self.evaluation.max_windows < 1:
            raise ValueError(f"data.evaluation.max_windows must be >= 1 or null, got {self.evaluation.max_windows}")
        validate_source(self.calibration.source, "data.calibration.source")
        for i, src in enumerate(self.evaluation.sources):
            validate_source(src, f"data.evaluation.sources[{i}]", for_eval=True)
        for what in ("train", "validation", "selection"):
            src = getattr(self, what).source
            if src is not None and src.chat is not None and what != "train":
                raise ValueError(f"data.{what}.source: a chat source reads as calibration or training windows only")
            if src is not None:
                validate_source(src, f"data.{what}.source")
        labels = [s.label for s in self.evaluation.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation sources need distinct names; got {labels} (set `name:` on each)")

    def describe(self) -> dict:
        """The sections as results.json records them (records held in memory by their count, not their text)."""
        sections = ("calibration", "evaluation", "train", "validation", "selection")
        return {k: _brief(asdict(getattr(self, k))) for k in sections}


def _brief(value):
    if isinstance(value, dict):
        return {k: f"{len(v)} in memory" if k == "records" and v else _brief(v) for k, v in value.items()}
    return [_brief(v) for v in value] if isinstance(value, list) else value


def section_settings(section) -> dict:
    """A data section's settings as a dict, less its source's `chat` and `records` while they are unset: what
    keys the statistics' fingerprint and the generated-text caches, so that those of a text source read as
    they did before chat sources existed."""
    out = asdict(section)
    for f in fields(section):
        if is_later(f) and out[f.name] is None:
            out.pop(f.name)
    source = out.get("source")
    if isinstance(source, dict):
        for key in ("chat", "records"):
            if source.get(key) is None:
                source.pop(key, None)
    return out
