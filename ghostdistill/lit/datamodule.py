"""The LightningDataModule: calibration windows (also the distillation data) and evaluation windows."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from ..core.io import atomic_torch_save, json_digest
from ..data import GENERATE, TextSource, calibration_windows, evaluation_windows, generate_windows, validate_source


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


class _Windows(Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


class GhostDataModule(LightningDataModule):
    """Windows for calibration (and later distillation) and for evaluation.

    Args:
        calibration: calibration text and size.
        evaluation: evaluation sources and window length.
        batch_size: windows per forward pass.
        num_workers: DataLoader workers (windows are pre-tokenised, so 0 is usually right).
    """

    def __init__(
        self,
        calibration: CalibrationData = CalibrationData(),
        evaluation: EvaluationData = EvaluationData(),
        batch_size: int = 4,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("calibration.num_samples", calibration.num_samples), ("calibration.seq_len",
                            calibration.seq_len), ("evaluation.seq_len", evaluation.seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if evaluation.max_windows is not None and evaluation.max_windows < 1:
            raise ValueError(f"evaluation.max_windows must be >= 1 or null, got {evaluation.max_windows}")
        validate_source(calibration.source)
        for src in evaluation.sources:
            validate_source(src)
        labels = [s.label for s in evaluation.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation sources need distinct names; got {labels} (set `name:` on each)")
        self.calibration = calibration
        self.evaluation = evaluation
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._calibration_ids: torch.Tensor | None = None
        self._eval_ids: dict[str, torch.Tensor] = {}

    def describe(self) -> dict:
        return {"calibration": asdict(self.calibration), "evaluation": asdict(self.evaluation)}

    def generated_cache(self, model_key: dict) -> Path:
        """Where self-generated calibration tokens are kept: keyed by the model that wrote them (its token
        ids mean nothing to another tokenizer) and the calibration settings."""
        key = json_digest({"model": model_key, "calibration": asdict(self.calibration), "batch_size": self.batch_size})
        return Path(self.trainer.default_root_dir) / f"generated_calibration_{key}.pt"

    # -------------------------------------------------------------- calibration
    def calibration_ids(self) -> torch.Tensor:
        if self._calibration_ids is None:
            module = self.trainer.lightning_module
            cal = self.calibration
            if cal.source.source == GENERATE:
                cache = self.generated_cache(asdict(module.model_cfg))
                if cache.is_file():
                    ids = torch.load(cache)
                else:
                    # Seeded: every rank samples the same text; only rank 0 keeps it.
                    with module.pruned.use("dense") if module.pruned else nullcontext():
                        ids = generate_windows(
                            module.llm, module.tokenizer, cal.seq_len, cal.num_samples, cal.seed, self.batch_size
                        )
                    if self.trainer.is_global_zero:
                        atomic_torch_save(ids, cache)
            else:
                ids = calibration_windows(module.tokenizer, cal.source, cal.seq_len, cal.num_samples, cal.seed)
            self._calibration_ids = ids
        return self._calibration_ids

    def calibration_dataloader(self) -> DataLoader:
        return DataLoader(_Windows(self.calibration_ids()), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        # Distillation trains on the calibration windows; training-free runs never draw from it.
        return DataLoader(_Windows(self.calibration_ids()), batch_size=self.batch_size, shuffle=True)

    # --------------------------------------------------------------- evaluation
    @property
    def test_sources(self) -> list[str]:
        return [s.label for s in self.evaluation.sources]

    def eval_ids(self, src: TextSource) -> torch.Tensor:
        if src.label not in self._eval_ids:
            module = self.trainer.lightning_module
            ev = self.evaluation
            if src.source == GENERATE:
                # Held-out self-generated text: a seed the calibration does not use.
                with module.pruned.use("dense") if module.pruned else nullcontext():
                    ids = generate_windows(module.llm, module.tokenizer, ev.seq_len, ev.max_windows or 8,
                                           seed=10_000 + self.calibration.seed, batch_size=self.batch_size)
            else:
                ids = evaluation_windows(module.tokenizer, src, ev.seq_len, ev.max_windows)
            self._eval_ids[src.label] = ids
        return self._eval_ids[src.label]

    def test_dataloader(self) -> list[DataLoader]:
        return [
            DataLoader(_Windows(self.eval_ids(src)), batch_size=self.batch_size, num_workers=self.num_workers)
            for src in self.evaluation.sources
        ]

    def eval_summary(self) -> dict:
        return {
            "seq_len": self.evaluation.seq_len,
            "max_windows": self.evaluation.max_windows,
            "sources": {
                s.label: {**s.describe(), "windows": int(len(self._eval_ids[s.label]))}
                for s in self.evaluation.sources
                if s.label in self._eval_ids
            },
        }

