"""The windows a run reads: calibration, distillation training and validation, and evaluation.

`RunData` turns the data settings (`data.config`) into token windows, each
computed once: it needs the tokenizer and, for self-generated (data-free) text or the dense model's answers,
the dense model that writes them. Nothing here knows about Lightning; the data module hands these windows to
its loaders.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.io import Resumable, atomic_torch_save, json_digest, partial_path
from .answers import ChatWindows
from .config import DISJOINT, DataConfig, section_settings
from .run_chat import chat_windows, check_chat_sources, evaluation_sources, score_source, statistics_masks
from .sources import GENERATE, TextSource
from .windows import calibration_windows, disjoint_windows, evaluation_windows, generate_windows, shared_ngrams

__all__ = ["RunData"]


class RunData:
    """Token windows of one run, each computed on first use and kept.

    Args:
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
        self._answers: torch.Tensor | None = None  # a chat calibration's answer tokens
        self._chat: dict[str, ChatWindows] = {}
        self._eval: dict[str, torch.Tensor] = {}
        self._train: torch.Tensor | None = None
        self._val: torch.Tensor | None = None
        self._selection: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size

    def made_by_dense(
        self,
        cache: Path | None,
        make: Callable[[nn.Module, Resumable], Any],
        *,
        to_file=lambda out: out,
        from_file=lambda saved: saved,
        needs="source: generate needs the dense model, which this run did not provide",
    ):
        """`make(dense model, keep)`, read from `cache` (`from_file` of it) when it is there, else made and kept
        there (`to_file` of it, by the process that writes); `keep` holds its batches beside `cache` as they come:
        an interrupted run resumes. `needs`: the error when the run gave no dense model."""
        if cache is not None and cache.is_file():
            return from_file(torch.load(cache, weights_only=True))
        if self.dense is None:
            raise ValueError(needs)
        keep = Resumable(partial_path(cache), self.write)
        with self.dense() as model:
            out = make(model, keep)
        if cache is not None and self.write:
            atomic_torch_save(to_file(out), cache)
        keep.finish()
        return out

    def _generated(
        self, cache: Path | None, seq_len: int, n: int, seed: int, batch_size: int | None = None, what="calibration"
    ) -> torch.Tensor:
        """Self-generated windows (`made_by_dense`); seeded: every rank samples the same text, rank 0 keeps it."""
        size = batch_size or self.batch_size
        return self.made_by_dense(
            cache,
            lambda model, keep: generate_windows(
                model, self.tokenizer, seq_len, n, seed, size, progress=self.progress, keep=keep, what=what
            ),
        )

    def generated_cache(self, what: str = "calibration", part: str = "") -> Path | None:
        """Where self-generated `what` (calibration, train) tokens are kept: keyed by the model that wrote them
        and the section's settings (`part` "more": the training windows `data.train.generated` adds)."""
        if self.run_dir is None:
            return None
        settings = section_settings(getattr(self.cfg, what))
        if (settings.get("source") or {}).get("chat"):
            settings["source"]["chat"].pop("tokens")  # what the statistics count, not what is written
        key = json_digest({"model": self.model_key, what: settings, "batch_size": self.batch_size})
        return Path(self.run_dir) / f"generated_{what}{part and '_' + part}_{key}.pt"

    def _windows(self, src: TextSource, seq_len: int, n: int, seed: int, cache: Path | None = None):
        """(ids, answer mask or None): `n` random windows of `src`, text, self-generated (kept in `cache`) or chat."""
        if src.chat is not None:
            return chat_windows(self, src, seq_len, n, seed, cache)
        if src.source != GENERATE:
            return calibration_windows(self.tokenizer, src, seq_len, n, seed), None
        return self._generated(cache, seq_len, n, seed), None

    def calibration_ids(self) -> torch.Tensor:
        if self._calibration is None:
            cal = self.cfg.calibration
            windows = self._windows(cal.source, cal.seq_len, cal.num_samples, cal.seed, self.generated_cache())
            self._calibration, self._answers = windows
        return self._calibration

    def calibration_batches(self) -> list[dict[str, torch.Tensor]]:
        ids, size = self.calibration_ids(), self.batch_size
        batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(size)]
        counted = statistics_masks(self.cfg.calibration.source, self._answers)
        for b, m in zip(batches, [] if counted is None else counted.split(size)):
            b["statistics_mask"] = m
        return batches

    @property
    def eval_sources(self) -> list[TextSource]:
        """The evaluation sources: the configured ones and the chat score's (`data.run_chat`)."""
        ev = self.cfg.evaluation
        return evaluation_sources(ev.sources, ev.chat, self.tokenizer)

    def eval_windows(self, src: TextSource) -> torch.Tensor | ChatWindows:
        """A source's evaluation windows: ids, or a chat source's `ChatWindows` (padding and answer masks)."""
        if src.chat is None:
            return self.eval_ids(src)
        if src.label not in self._chat:
            # The dense model's answers, kept keyed by the model that wrote them and the source's settings.
            key = json_digest({"model": self.model_key, "source": asdict(src)})
            cache = None if self.run_dir is None else Path(self.run_dir) / f"chat_answers_{key}.pt"
            self._chat[src.label] = score_source(self, src, cache)
        return self._chat[src.label]

    def eval_ids(self, src: TextSource) -> torch.Tensor:
        if src.chat is not None:
            return self.eval_windows(src).input_ids
        if src.label not in self._eval:
            ev = self.cfg.evaluation
            if src.source == GENERATE:
                # Held-out self-generated text: a seed the calibration does not use.
                ids = self._generated(None, ev.seq_len, ev.max_windows or 8, 10_000 + self.cfg.calibration.seed)
            else:
                ids = evaluation_windows(self.tokenizer, src, ev.seq_len, ev.max_windows)
            self._eval[src.label] = ids
        return self._eval[src.label]

    def train_ids(self) -> torch.Tensor:
        if self._train is None:
            tr = self.cfg.train
            if tr.source is None:
                ids = self.calibration_ids()
            elif tr.cut == DISJOINT:
                ids = disjoint_windows(
                    self.tokenizer, [tr.source, *(tr.more_sources or [])], tr.seq_len, tr.num_samples
                )
            else:
                ids = self._windows(tr.source, tr.seq_len, tr.num_samples, tr.seed, self.generated_cache("train"))[0]
            for src in [tr.source or self.cfg.calibration.source, *(tr.more_sources or [])]:
                self._check_disjoint("training", src, ids)
            if tr.generated:
                cache = self.generated_cache("train", "more")
                more = self._generated(
                    cache, ids.shape[1], tr.generated, 30000 + tr.seed, tr.generate_batch, "training"
                )
                ids = torch.cat([ids, more])
            self._train = ids
        return self._train

    def val_ids(self) -> torch.Tensor | None:
        va = self.cfg.validation
        if self._val is None and va.source is not None:
            ids = evaluation_windows(self.tokenizer, va.source, va.seq_len, va.num_windows)
            self._check_disjoint("validation", va.source, ids)
            self._val = ids
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
                ids = self._windows(cal.source, sel.seq_len, sel.num_windows, 20_000 + cal.seed)[0]
            else:
                ids = evaluation_windows(self.tokenizer, sel.source, sel.seq_len, sel.num_windows)
                self._check_disjoint("selection", sel.source, ids)
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
        for what in ("train", "validation") if distilling else ():
            if getattr(self.cfg, what).source is not None:
                lengths[what] = getattr(self.cfg, what).seq_len
        for what, n in lengths.items():
            if max_positions and n > max_positions:
                warnings.warn(
                    f"data.{what}.seq_len {n} is longer than the model's position limit "
                    f"(max_position_embeddings {max_positions}): positions beyond it were never trained",
                    stacklevel=2,
                )
        check_chat_sources(self, distilling)
        for src in self.cfg.evaluation.sources:
            if src.source != GENERATE and src.chat is None:
                self.eval_ids(src)
        if distilling:
            self.train_ids()
            self.val_ids()

    def _check_disjoint(self, what: str, src: TextSource, ids: torch.Tensor) -> None:
        """Windows for training, validation or selection must share no 32-token run with an evaluation window of
        the same text (same file or hub data set), nor selection windows with a calibration window; a clear error
        names both and how to separate them."""
        against = {
            f"the evaluation windows of {ev.label!r}": (ev, partial(self.eval_ids, ev))
            for ev in self.cfg.evaluation.sources
        }
        if what == "selection":
            against["the calibration windows"] = (self.cfg.calibration.source, self.calibration_ids)
        for whose, (other, windows) in against.items():
            if _same_text(src, other) and (hits := shared_ngrams(ids, windows())):
                raise ValueError(
                    f"{len(hits)} {what} windows of {src.source!r} overlap {whose} (the same text): take them from "
                    "other documents (first_document / max_documents) or another source"
                )

    def summary(self) -> dict:
        """What the evaluation read (and, after distillation, what training and validation read)."""
        ev = self.cfg.evaluation
        summary: dict = {
            "seq_len": ev.seq_len,
            "max_windows": ev.max_windows,
            "sources": {
                s.label: {**s.describe(), "windows": len(self._eval.get(s.label, self._chat.get(s.label, [])))}
                | ({"answer_tokens": s.chat.answer_tokens("score")} if s.chat else {})
                for s in self.eval_sources
                if s.label in self._eval or s.label in self._chat
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
