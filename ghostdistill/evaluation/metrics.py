"""Per-token language-model metrics computed chunk by chunk over positions.

Float32 log-probabilities of a whole batch over a 128k vocabulary take gigabytes, so logits are turned
into metrics a slice of positions at a time: next-token NLL (perplexity), and against a reference
model's log-probabilities (the dense teacher) KL(reference ‖ model) and top-1 agreement. Shared by
evaluation (`test_step`) and the `ppl` / `taylor` plan criteria.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def next_token_targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid): the token each position predicts, and whether both it and its input are real."""
    return ids[:, 1:], (mask[:, 1:] * mask[:, :-1]).bool()


@dataclass
class TokenScores:
    """Per position [batch, seq-1]: NLL of the target; with a reference, KL(reference ‖ model) in nats and
    whether the argmax agrees with the reference's. `logprobs`: the model's log-probability chunks when
    asked for (to serve as the reference of later models)."""

    nll: torch.Tensor
    kl: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    logprobs: list[torch.Tensor] | None = None


def score_tokens(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    reference: list[torch.Tensor] | None = None,
    chunk: int = 1024,
    keep_logprobs: bool = False,
) -> TokenScores:
    """Metrics of next-token `logits` [batch, seq-1, vocab] against `targets` [batch, seq-1], `chunk`
    positions at a time. `reference`: another model's log-probability chunks for the same positions
    (as returned with `keep_logprobs`), chunked alike."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of positions, got {chunk}")
    nll, kl, top1, kept = [], [], [], []
    for k, lo in enumerate(range(0, logits.shape[1], chunk)):
        logp = F.log_softmax(logits[:, lo : lo + chunk].float(), dim=-1)
        nll.append(-logp.gather(-1, targets[:, lo : lo + chunk, None]).squeeze(-1))
        if reference is not None:
            ref = reference[k]
            kl.append((ref.exp() * (ref - logp)).sum(-1))
            top1.append((ref.argmax(-1) == logp.argmax(-1)).float())
        if keep_logprobs:
            kept.append(logp)
    return TokenScores(
        nll=torch.cat(nll, 1),
        kl=torch.cat(kl, 1) if reference is not None else None,
        top1=torch.cat(top1, 1) if reference is not None else None,
        logprobs=kept if keep_logprobs else None,
    )


def next_token_nll(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL (float32, differentiable) over positions whose token and target are both
    real, and how many there are. `logits` are the model's output for `ids` (all positions)."""
    targets, valid = next_token_targets(ids, mask)
    step = max(1, chunk_tokens // max(1, ids.shape[0]))
    scores = score_tokens(logits[:, :-1], targets, chunk=step)
    return torch.where(valid, scores.nll, 0.0).sum(), int(valid.sum())
