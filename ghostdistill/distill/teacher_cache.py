"""The teacher's outputs computed once and reused: its top-k next-token log-probabilities per training window.

A distillation step used to run the dense teacher again on every batch, every epoch and every run. With
`distill.teacher_topk: k` the teacher's view of a window is kept as, per position t,

    log p_T(v) for its k most likely tokens v (float16),  v (16-bit ids where the vocabulary allows, else 32),
    log r_T = log(1 − Σ_{top-k} p_T), its tail mass (float32, from the full logits in float32),

about 4k + 4 bytes a token (260 B at k = 64; LinearPatch caches k = 50 logits in 16 bits the same way), at the
distillation temperature. The loss against it is `loss.cached_token_losses` (the tail handled explicitly).

Windows are found by content: a window's file is named by the digest of its tokens and mask, under a folder
named by the digest of what decides the teacher's outputs (the model's settings, k, the temperature, this
format). So every student, every later run and every plan of the same model reads what any of them wrote, and a
changed model, text or k can never read a stale entry. Files are written atomically (`core.io`); one that does
not load is computed again. The folder is `$GHOSTDISTILL_CACHE/teacher_topk/<key>` (`core.model.cache_root`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch

from ..core.head import token_chunks
from ..core.io import atomic_torch_save, json_digest
from ..core.model import cache_root

FORMAT = 1


def topk_entry(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probabilities [N, k] float32, ids [N, k] int64, log tail mass [N] float32) of logits [N, V] at
    `temperature`, the k most likely first; the tail from the full distribution in float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    values, index = logp.topk(min(k, logp.shape[-1]), dim=-1)
    if index.shape[-1] < logp.shape[-1]:
        tail = torch.logsumexp(logp.scatter(-1, index, float("-inf")), dim=-1)
    else:
        tail = torch.full(values.shape[:-1], float("-inf"))
    return values, index, tail


def window_digest(ids: torch.Tensor, mask: torch.Tensor) -> str:
    """A window's name in the cache: the digest of its tokens and mask."""
    h = hashlib.sha256(ids.to("cpu", torch.int64).numpy().tobytes())
    h.update(mask.to("cpu", torch.int8).numpy().tobytes())
    return h.hexdigest()[:32]


class TeacherCache:
    """Top-k teacher outputs by window (see the module docstring). `folder`: where (default: under the cache
    root, by `key`); `write`: whether this process writes the files it computes (rank 0 of several)."""

    def __init__(
        self, key: dict, k: int, temperature: float, vocab: int, folder: Path | None = None, write: bool = True
    ) -> None:
        self.k, self.temperature, self.write = k, temperature, write
        self.small_ids = vocab <= 1 << 16  # ids stored in 16 bits (read back as unsigned)
        digest = json_digest({"format": FORMAT, "model": key, "k": k, "temperature": temperature})
        self.folder = Path(folder) if folder is not None else cache_root() / "teacher_topk" / digest
        self.hits = self.misses = 0

    def _path(self, name: str) -> Path:
        return self.folder / name[:2] / f"{name}.pt"

    def _read(self, name: str):
        path = self._path(name)
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, weights_only=True)
            logp, index, tail = saved["logp"].float(), saved["index"].long(), saved["tail"].float()
        except Exception:  # truncated or foreign: computed again and replaced
            return None
        if self.small_ids:
            index = index & 0xFFFF
        return logp, index, tail

    def lookup(self, ids: torch.Tensor, mask: torch.Tensor):
        """The batch's cached outputs ([batch, seq − 1, k], [batch, seq − 1, k], [batch, seq − 1]), or None
        if any window is missing (the caller then runs the teacher and calls `store`)."""
        rows = [self._read(window_digest(i, m)) for i, m in zip(ids, mask)]
        if any(r is None for r in rows):
            self.misses += 1
            return None
        self.hits += 1
        return tuple(torch.stack(parts).to(ids.device) for parts in zip(*rows))

    @torch.no_grad()
    def store(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        hidden: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        chunk_tokens: int,
    ):
        """Compute the batch's top-k from the teacher's final hidden states [batch, seq, C] (positions
        0 … seq − 2 predict the next token), write each window's file (unless `write` is off), return what
        `lookup` would."""
        rows = []
        for i, m, h in zip(ids, mask, hidden[:, :-1]):
            parts = [topk_entry(head(h[c]), self.k, self.temperature) for c in token_chunks(len(h), chunk_tokens)]
            logp, index, tail = (torch.cat(p) for p in zip(*parts))
            if self.write:
                stored = index.to(torch.int16 if self.small_ids else torch.int32).cpu()
                entry = {"logp": logp.half().cpu(), "index": stored, "tail": tail.cpu()}
                atomic_torch_save(entry, self._path(window_digest(i, m)))  # its folder made as it is written
            # What later runs read: the 16-bit log-probabilities, so a step's loss is the same cached or not.
            rows.append((logp.half().float(), index, tail))
        return tuple(torch.stack(parts).to(ids.device) for parts in zip(*rows))
