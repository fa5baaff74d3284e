"""The LightningDataModule: the run's windows (`data.run`) as DataLoaders, with the samplers that
make several processes read each window once."""

from __future__ import annotations

import itertools

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ..data import ChatWindows
from ..data.config import CalibrationData, DataConfig, EvaluationData, SelectionData, TrainData, ValidationData
from ..data.run import RunData


class _Windows(Dataset):
    """Windows by index; an index i ≥ len marks a padding copy of window i − len (`counted` false). A chat
    source's windows (`ChatWindows`) come with their attention mask and answer tokens."""

    def __init__(self, ids: torch.Tensor | ChatWindows) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n, w = len(self.ids), self.ids
        if isinstance(w, ChatWindows):
            item = {k: getattr(w, k)[i % n] for k in ("input_ids", "attention_mask", "answers")}
        else:
            item = {"input_ids": w[i % n], "attention_mask": torch.ones_like(w[i % n])}
        return {**item, "counted": torch.tensor(i < n)}


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
        # The global stream of window indices, after the windows already used.
        epoch, offset = divmod(self.start_batch * per_global, len(self.ids))
        later = itertools.chain.from_iterable(map(self.order, itertools.count(epoch + 1)))
        stream = itertools.chain(self.order(epoch)[offset:], later)
        while True:
            chunk = list(itertools.islice(stream, per_global))
            for i in chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]:
                yield {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


class GhostDataModule(LightningDataModule):
    """Windows for calibration, distillation (training, validation) and evaluation, as DataLoaders.

    The windows themselves come from the run's `data.run.RunData` (`GhostDistill.run.data`), which
    `Run.setup` binds to the model's tokenizer and dense model before anything is read. These settings
    are linked into the module's `data` when `fit` builds it (`runner.fit`), so the run's config is complete.

    Args:
        calibration: calibration text and size.
        evaluation: evaluation sources and window length.
        train: distillation training windows.
        validation: held-out windows validated during distillation.
        batch_size: windows per forward pass.
        selection: held-out windows the repair-aware plan criteria score candidates on.
        num_workers: DataLoader workers for evaluation (windows are pre-tokenised, so 0 is usually right).
    """

    def __init__(
        self,
        calibration: CalibrationData = CalibrationData(),
        evaluation: EvaluationData = EvaluationData(),
        train: TrainData = TrainData(),
        validation: ValidationData = ValidationData(),
        batch_size: int = 4,
        num_workers: int = 0,
        selection: SelectionData = SelectionData(),
    ) -> None:
        super().__init__()
        self.cfg = DataConfig(calibration, evaluation, train, validation, batch_size, selection, num_workers)
        self.cfg.validate()
        self.batch_size = batch_size

    @property
    def data(self) -> RunData:
        """The run's windows (bound by `Run.setup`)."""
        return self.trainer.lightning_module.run.data

    def train_dataloader(self) -> DataLoader:
        """Each rank's share of the deterministic window stream, from the batch a resumed run reached."""
        trainer = self.trainer
        start = trainer.global_step * trainer.accumulate_grad_batches
        dataset = StepWindows(
            self.data.train_ids(), self.batch_size, self.cfg.train.seed, trainer.global_rank, trainer.world_size, start
        )
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=0)

    def test_dataloader(self) -> list[DataLoader]:
        trainer = self.trainer

        def loader(windows: _Windows) -> DataLoader:
            # Lightning keeps a DistributedSampler it is given: ours pads without counting windows twice.
            sampler = EvenShares(windows, trainer.world_size, trainer.global_rank) if trainer.world_size > 1 else None
            return DataLoader(windows, batch_size=self.batch_size, num_workers=self.cfg.num_workers, sampler=sampler)

        return [loader(_Windows(self.data.eval_windows(src))) for src in self.data.eval_sources]
