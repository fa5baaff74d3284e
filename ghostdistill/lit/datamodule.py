"""The LightningDataModule: calibration windows, distillation training and validation windows, and
evaluation windows."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

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


class _Windows(Dataset):
    """Windows by index; an index i ≥ len marks a padding copy of window i − len (`counted` false)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self.ids)
        window = self.ids[i % n]
        return {"input_ids": window, "attention_mask": torch.ones_like(window), "counted": torch.tensor(i < n)}


class EvenShares(DistributedSampler):
    """Every rank gets ⌈n / world⌉ windows in order (rank r: windows r, r + world, ...), as Lightning's
    DistributedSampler gives, so sharded models run the same number of forwards on every rank; but the
    windows added to even out the shares come as index i + n, which `_Windows` marks as not counted, so
    each real window is counted exactly once and perplexity is that of one process. (Lightning's own
    sampler repeats the first windows, which then count twice.)"""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self):
        n = len(self.dataset)
        padded = list(range(n)) + [n + i % n for i in range(self.total_size - n)]
        return iter(padded[self.rank : self.total_size : self.num_replicas])


class StepWindows(IterableDataset):
    """An endless, deterministic stream of training windows that starts at a given batch.

    The global order is one seeded permutation of the windows per epoch, (seed, epoch) deciding each;
    global batch k holds `batch_size · world_size` consecutive windows of it, and rank r reads its
    `batch_size` slice. The stream starts at global batch `start_batch`, so a resumed run continues
    with exactly the batches the interrupted one had not yet seen.
    """

    def __init__(self, ids: torch.Tensor, batch_size: int, seed: int, rank: int, world: int, start_batch: int) -> None:
        self.ids, self.batch_size, self.seed = ids, batch_size, seed
        self.rank, self.world, self.start_batch = rank, world, start_batch

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.ids), generator=g).tolist()

    def __iter__(self):
        per_global = self.batch_size * self.world
        position = self.start_batch * per_global  # windows of the global stream already used
        epoch, offset = divmod(position, len(self.ids))
        order = self.order(epoch)
        while True:
            chunk = []
            while len(chunk) < per_global:
                if offset == len(order):
                    epoch, offset = epoch + 1, 0
                    order = self.order(epoch)
                take = min(per_global - len(chunk), len(order) - offset)
                chunk += order[offset : offset + take]
                offset += take
            for i in chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]:
                yield {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


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
        train: TrainData = TrainData(),
        validation: ValidationData = ValidationData(),
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
        for name, value in (("train.num_samples", train.num_samples), ("train.seq_len", train.seq_len),
                            ("validation.num_windows", validation.num_windows),
                            ("validation.seq_len", validation.seq_len)):
            if value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        validate_source(calibration.source)
        for src in (*evaluation.sources, train.source, validation.source):
            if src is not None:
                validate_source(src)
        labels = [s.label for s in evaluation.sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"evaluation sources need distinct names; got {labels} (set `name:` on each)")
        self.calibration = calibration
        self.evaluation = evaluation
        self.train = train
        self.validation = validation
        self.batch_size = batch_size
        self.num_workers = num_workers
        self._calibration_ids: torch.Tensor | None = None
        self._eval_ids: dict[str, torch.Tensor] = {}
        self._train_ids: torch.Tensor | None = None
        self._val_ids: torch.Tensor | None = None

    def describe(self) -> dict:
        return {
            "calibration": asdict(self.calibration),
            "evaluation": asdict(self.evaluation),
            "train": asdict(self.train),
            "validation": asdict(self.validation),
        }

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

    # ------------------------------------------------------------ distillation
    def train_ids(self) -> torch.Tensor:
        if self._train_ids is None:
            tr = self.train
            if tr.source is None:
                ids = self.calibration_ids()
            else:
                ids = calibration_windows(self.trainer.lightning_module.tokenizer, tr.source, tr.seq_len,
                                          tr.num_samples, tr.seed)
            self._check_disjoint("training", tr.source or self.calibration.source, ids)
            self._train_ids = ids
        return self._train_ids

    def val_ids(self) -> torch.Tensor | None:
        if self._val_ids is None and self.validation.source is not None:
            va = self.validation
            ids = evaluation_windows(self.trainer.lightning_module.tokenizer, va.source, va.seq_len, va.num_windows)
            self._check_disjoint("validation", va.source, ids)
            self._val_ids = ids
        return self._val_ids

    def _check_disjoint(self, what: str, src: TextSource, ids: torch.Tensor) -> None:
        """Windows for training or validation must share no 32-token run with an evaluation window of the
        same text (same file or hub data set); a clear error names both and how to separate them."""
        for ev in self.evaluation.sources:
            if _same_text(src, ev):
                hits = shared_ngrams(ids, self.eval_ids(ev))
                if hits:
                    raise ValueError(
                        f"{len(hits)} {what} windows of {src.source!r} overlap the evaluation windows of "
                        f"{ev.label!r} (the same text): take them from other documents (first_document / "
                        "max_documents) or another source"
                    )

    def train_dataloader(self) -> DataLoader:
        """Each rank's share of the deterministic window stream, from the batch a resumed run reached."""
        trainer = self.trainer
        start = trainer.global_step * trainer.accumulate_grad_batches
        dataset = StepWindows(self.train_ids(), self.batch_size, self.train.seed, trainer.global_rank,
                              trainer.world_size, start)
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=0)

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
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        loaders = []
        for src in self.evaluation.sources:
            windows = _Windows(self.eval_ids(src))
            # Lightning keeps a DistributedSampler it is given: ours pads without counting windows twice.
            sampler = EvenShares(windows, world, trainer.global_rank) if world > 1 else None
            loaders.append(DataLoader(windows, batch_size=self.batch_size, num_workers=self.num_workers, sampler=sampler))
        return loaders

    def eval_summary(self) -> dict:
        """What the evaluation read (and, after distillation, what training and validation read)."""
        summary = self._eval_summary()
        if self._train_ids is not None:
            summary["train"] = {
                **asdict(self.train),
                "source": asdict(self.train.source) if self.train.source else "the calibration windows",
                "windows": len(self._train_ids),
                "seq_len": int(self._train_ids.shape[1]),
            }
        if self._val_ids is not None:
            summary["validation"] = {**asdict(self.validation), "windows": len(self._val_ids)}
        return summary

    def _eval_summary(self) -> dict:
        return {
            "seq_len": self.evaluation.seq_len,
            "max_windows": self.evaluation.max_windows,
            "sources": {
                s.label: {**s.describe(), "windows": len(self._eval_ids[s.label])}
                for s in self.evaluation.sources
                if s.label in self._eval_ids
            },
        }



def _same_text(a: TextSource, b: TextSource) -> bool:
    """Whether two sources read the same text (a hub data set and split, or the same file)."""
    if a.source == GENERATE or b.source == GENERATE:
        return False
    pa, pb = Path(a.source).expanduser(), Path(b.source).expanduser()
    if pa.is_file() and pb.is_file():
        return pa.resolve() == pb.resolve()
    return a.source == b.source
