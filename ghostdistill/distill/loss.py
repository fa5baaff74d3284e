"""Distillation losses between a student's and the teacher's next-token distributions, chunked over tokens.

Per token t (p = softmax(z/τ) of the teacher T and the student S at temperature τ):

    forward   KL(T ‖ S) = Σ_v p_T (log p_T − log p_S)      (the default: Minitron found it best, τ = 1)
    reverse   KL(S ‖ T) = Σ_v p_S (log p_S − log p_T)
    symmetric ½ (forward + reverse)

each multiplied by τ² so that gradients keep their scale as τ changes (Hinton et al. 2015). With
`top_k`, the teacher keeps only its k most likely tokens, renormalised over them (LinearPatch's recipe,
k = 50): forward KL = Σ_{v ∈ top-k} p̃_T (log p̃_T − log p_S), with the student's full log-softmax.
Minitron reports that top-k (k ≤ 100) costs accuracy, so it is off by default. `ce_weight` = α mixes in
the ordinary next-token cross-entropy on the labels: (1 − α)·KD + α·CE (torchtune's `kd_ratio` is 1 − α).

An optional hidden-state term (Minitron adds one for heavy depth cuts) compares the residual stream h
entering the first block after each gap (after the student's operator; for a gap at the end of the
stack, the stream entering the final norm) with the teacher's at the same place, per position t:

    mse     (1/C) Σ_c (h_S − h_T)²
    cosine  1 − cos(h_S, h_T)

averaged over the real positions (the first position left out unless `hidden_first`: its massive
activation is orders of magnitude larger than every other position's and would be all an MSE sees) and
over the gaps, and added as `hidden_weight` · term (`hidden_state_loss`, chunked like the logits).

With the teacher's outputs cached (`distill.teacher_topk` = k: `teacher_cache.py`), the teacher is known only
through its k most likely tokens K, their log-probabilities log p_T(v), v ∈ K, and its tail mass
r_T = 1 − Σ_K p_T (kept in float32 from the full logits). Both distributions are then compared on the k + 1
outcomes K ∪ {rest}, the student's rest being its own mass off K, r_S = 1 − Σ_K p_S (from its full logits):

    forward   Σ_K p_T (log p_T − log p_S) + r_T (log r_T − log r_S)
    reverse   Σ_K p_S (log p_S − log p_T) + r_S (log r_S − log r_T)

This is the KL between the two distributions with the tail lumped into one outcome: never more than the
full-vocabulary KL (lumping loses information), equal to it when K covers the vocabulary (r = 0; tested), and
off by at most the KL between the two tails' shapes, weighted by their mass, otherwise. With `loss.top_k` ≤ k
as well, the cached tokens are renormalised over the top_k as without a cache (LinearPatch's recipe).

The logit loss is the mean over real (non-padding) target tokens. `chunked_distillation_loss` applies the
output head to the final hidden states a chunk of tokens at a time inside activation checkpointing, so neither
model's [tokens, vocab] logits exist for more than one chunk, forward or backward; `distillation_loss` is the
plain version over full logits, tested equal to it, gradients included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..core.head import token_chunks

KLKind = Literal["forward", "reverse", "symmetric"]
HiddenKind = Literal["mse", "cosine"]


@dataclass
class LossConfig:
    """The distillation objective.

    Args:
        kind: ``forward`` KL(teacher ‖ student) (default), ``reverse`` KL(student ‖ teacher), ``symmetric``.
        temperature: softens both distributions; the KL is scaled by temperature² (1 = none).
        top_k: keep only the teacher's top-k tokens, renormalised (LinearPatch uses 50); null = all.
        ce_weight: α in (1 − α)·KD + α·CE on the labels (0 = KD only).
        chunk_tokens: tokens per chunk of the output head and the loss (bounds memory).
        hidden_weight: weight of the hidden-state term beside the logit loss (0 = off).
        hidden_kind: ``mse`` or ``cosine`` between the student's and the teacher's residual streams.
        hidden_first: include the first position in the hidden-state term.
    """

    kind: KLKind = "forward"
    temperature: float = 1.0
    top_k: int | None = None
    ce_weight: float = 0.0
    chunk_tokens: int = 1024
    hidden_weight: float = 0.0
    hidden_kind: HiddenKind = "mse"
    hidden_first: bool = False

    def validate(self) -> None:
        if self.kind not in ("forward", "reverse", "symmetric"):
            raise ValueError(f"distill.loss.kind {self.kind!r} is not known; choose forward, reverse or symmetric")
        if not self.temperature > 0:
            raise ValueError(f"distill.loss.temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"distill.loss.top_k must be >= 1 or null (all tokens), got {self.top_k}")
        if not 0.0 <= self.ce_weight <= 1.0:
            raise ValueError(f"distill.loss.ce_weight must be in [0, 1], got {self.ce_weight}")
        if self.chunk_tokens < 1:
            raise ValueError(f"distill.loss.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if not self.hidden_weight >= 0:
            raise ValueError(
                f"distill.loss.hidden_weight must be >= 0 (0: no hidden-state term), got {self.hidden_weight}"
            )
        if self.hidden_kind not in ("mse", "cosine"):
            raise ValueError(f"distill.loss.hidden_kind {self.hidden_kind!r} is not known; choose mse or cosine")


def token_losses(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor:
    """Per-token loss [N] for student and teacher logits [N, V] (float32 inside) and labels [N]."""
    tau = cfg.temperature
    s = F.log_softmax(student_logits.float() / tau, dim=-1)
    with torch.no_grad():
        t_logits = teacher_logits.float() / tau
        if cfg.top_k is not None and cfg.top_k < t_logits.shape[-1]:
            values, index = t_logits.topk(cfg.top_k, dim=-1)
            t = F.log_softmax(values, dim=-1)  # renormalised over the teacher's top-k
        else:
            index, t = None, F.log_softmax(t_logits, dim=-1)
    s_on_t = s if index is None else s.gather(-1, index)
    return _with_ce(_kd(s_on_t, t, index is not None, cfg) * tau**2, student_logits, targets, cfg)


def cached_token_losses(
    student_logits: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    targets: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor:
    """Per-token loss [N] against the teacher's cached top-k (log-probabilities [N, k] at `cfg.temperature`,
    token ids [N, k], log tail mass [N]): the k + 1 outcome KL of the module docstring."""
    logp, index, log_tail = (t.to(student_logits.device) for t in teacher)
    tau = cfg.temperature
    if cfg.top_k is not None and cfg.top_k < logp.shape[-1]:
        # `token_losses`' renormalised top-k: renormalising log-probabilities over the top k gives what
        # renormalising the logits does.
        s_on_t = F.log_softmax(student_logits.float() / tau, dim=-1).gather(-1, index[:, : cfg.top_k])
        kd = _kd(s_on_t, F.log_softmax(logp[:, : cfg.top_k].float(), dim=-1), True, cfg)
        return _with_ce(kd * tau**2, student_logits, targets, cfg)
    z = student_logits.float() / tau
    log_z = torch.logsumexp(z, dim=-1)
    s = z.gather(-1, index) - log_z[:, None]
    # The student's mass off the teacher's tokens, from its own logits (exact, unlike 1 − Σ p_S in float32).
    if index.shape[-1] < z.shape[-1]:
        s_tail = torch.logsumexp(z.scatter(-1, index, float("-inf")), dim=-1) - log_z
    else:  # k covers the vocabulary: no tail (and no logsumexp of nothing, whose gradient is NaN)
        s_tail = torch.full_like(log_z, float("-inf"))
    t, t_tail = logp.float(), log_tail.float()

    def lumped(p_log, q_log, p_tail, q_tail):  # KL(p ‖ q) on the k + 1 outcomes; a tail of no mass adds 0
        has = p_tail > float("-inf")  # masked before the arithmetic, so no NaN reaches a gradient either
        p_t, q_t = torch.where(has, p_tail, 0.0), torch.where(has, q_tail.clamp_min(-1e4), 0.0)
        return (p_log.exp() * (p_log - q_log)).sum(-1) + torch.where(has, p_t.exp() * (p_t - q_t), 0.0)

    losses = []
    if cfg.kind in ("forward", "symmetric"):
        losses.append(lumped(t, s, t_tail, s_tail))
    if cfg.kind in ("reverse", "symmetric"):
        losses.append(lumped(s, t, s_tail, t_tail))
    kd = sum(losses) / len(losses) * tau**2
    return _with_ce(kd, student_logits, targets, cfg)


def _kd(s_on_t: torch.Tensor, t: torch.Tensor, renormalise: bool, cfg: LossConfig) -> torch.Tensor:
    losses = []
    if cfg.kind in ("forward", "symmetric"):
        losses.append((t.exp() * (t - s_on_t)).sum(-1))
    if cfg.kind in ("reverse", "symmetric"):
        # Over the teacher's support: with top-k the student's mass is renormalised there too.
        s_rev = F.log_softmax(s_on_t, dim=-1) if renormalise else s_on_t
        losses.append((s_rev.exp() * (s_rev - t)).sum(-1))
    return sum(losses) / len(losses)


def _with_ce(kd: torch.Tensor, student_logits, targets, cfg: LossConfig) -> torch.Tensor:
    if cfg.ce_weight > 0:
        if targets is None:
            raise ValueError("ce_weight > 0 needs the labels")
        ce = F.cross_entropy(student_logits.float(), targets, reduction="none")
        return (1.0 - cfg.ce_weight) * kd + cfg.ce_weight * ce
    return kd


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    valid: torch.Tensor,
    targets: torch.Tensor | None,
    cfg: LossConfig,
) -> torch.Tensor:
    """The plain loss: mean over the `valid` positions of [batch, seq, vocab] logits (the reference)."""
    n = int(valid.sum())
    if n == 0:
        return student_logits.sum() * 0.0
    y = targets[valid] if targets is not None else None
    return token_losses(student_logits[valid], teacher_logits[valid], y, cfg).sum() / n


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    valid: torch.Tensor,
    targets: torch.Tensor | None,
    cfg: LossConfig,
    teacher_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The same loss from final hidden states [batch, seq, C] (after the final norm) and the output head
    (`teacher_head` for the teacher's side when the student has its own head: `tail`), `cfg.chunk_tokens`
    tokens at a time, each chunk checkpointed: the backward recomputes its logits instead of keeping them."""
    s = student_hidden[valid]
    with torch.no_grad():
        t = teacher_hidden[valid]
    y = targets[valid] if targets is not None else None
    n = s.shape[0]
    if n == 0:
        return student_hidden.sum() * 0.0

    def chunk_loss(s_chunk: torch.Tensor, t_chunk: torch.Tensor, y_chunk: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            t_logits = (teacher_head or head)(t_chunk)
        return token_losses(head(s_chunk), t_logits, y_chunk, cfg).sum()

    return _chunked_sum(chunk_loss, n, cfg.chunk_tokens, s, t, y) / n


def cached_rows(student_hidden, valid, targets, teacher):
    """The real positions of a batch: the student's hidden states [n, C], the teacher's cached top-k rows and the
    labels (or None)."""
    rows = tuple(t[valid.to(t.device)] for t in teacher)
    return student_hidden[valid], rows, targets[valid] if targets is not None else None


def chunked_cached_loss(
    student_hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    valid: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: LossConfig,
) -> torch.Tensor:
    """`chunked_distillation_loss` against the teacher's cached top-k ([batch, seq, k], [batch, seq, k],
    [batch, seq], as `teacher_cache.TeacherCache.lookup` gives them) instead of the teacher's hidden states."""
    s, (logp, index, tail), y = cached_rows(student_hidden, valid, targets, teacher)
    n = s.shape[0]
    if n == 0:
        return student_hidden.sum() * 0.0

    def chunk_loss(s_chunk, logp_chunk, index_chunk, tail_chunk, y_chunk):
        return cached_token_losses(head(s_chunk), (logp_chunk, index_chunk, tail_chunk), y_chunk, cfg).sum()

    return _chunked_sum(chunk_loss, n, cfg.chunk_tokens, s, logp, index, tail, y) / n


def _chunked_sum(loss: Callable, n: int, chunk_tokens: int, s: torch.Tensor, *others) -> torch.Tensor:
    """Σ `loss` over chunks of `chunk_tokens` of the `n` rows of `s` and `others` (None stays None), in float32;
    each chunk inside activation checkpointing when `s` needs gradients."""
    total = s.new_zeros((), dtype=torch.float32)
    for part in token_chunks(n, chunk_tokens):
        args = [s[part], *(x[part] if x is not None else None for x in others)]
        total = total + (checkpoint(loss, *args, use_reentrant=False) if s.requires_grad else loss(*args))
    return total


def hidden_positions(mask: torch.Tensor, first: bool) -> torch.Tensor:
    """The positions [batch, seq] the hidden-state term averages over: real tokens, without position 0
    unless `first`."""
    valid = mask.bool().clone()
    if not first:
        valid[:, 0] = False
    return valid


def hidden_state_loss(
    student: list[torch.Tensor],
    teacher: list[torch.Tensor],
    valid: torch.Tensor,
    kind: HiddenKind = "mse",
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """The hidden-state term: per gap the mean over the `valid` positions of the per-position distance
    (`kind`) between the student's and the teacher's streams [batch, seq, C], averaged over the gaps;
    float32, `chunk_tokens` positions at a time (each chunk checkpointed, so no float32 copy of a whole
    stream is kept for the backward)."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden_state_loss: {len(student)} student streams for {len(teacher)} teacher streams")

    def chunk_loss(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        s, t = s.float(), t.float()
        if kind == "mse":
            return (s - t).pow(2).mean(-1).sum()
        return (1.0 - F.cosine_similarity(s, t, dim=-1)).sum()

    n = int(valid.sum())
    if n == 0:
        return sum(s.sum() for s in student) * 0.0
    total = student[0].new_zeros((), dtype=torch.float32)
    for s_full, t_full in zip(student, teacher):
        s = s_full[valid]
        with torch.no_grad():
            t = t_full[valid]
        total = total + _chunked_sum(chunk_loss, n, chunk_tokens, s, t) / n
    return total / len(student)
