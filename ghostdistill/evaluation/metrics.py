"""Per-token language-model metrics computed chunk by chunk.

Per token t with target y_t, model log-probabilities log p = log_softmax(z_t) and a reference model's
log q (the dense teacher): NLL = −log p(y_t) (perplexity = exp of its mean), KL(q ‖ p) = Σ_v q_v (log q_v
− log p_v) in nats, and top-1 agreement [argmax p = argmax q].

Float32 logits of a whole batch over a 262k vocabulary take gigabytes (4 × 512 × 262,144 × 4 bytes =
2 GiB, each log-softmax as much again), so nothing of size [batch, seq, vocab] is ever held:

- `score_hidden` (evaluation and validation) starts from every view's final hidden states and applies
  the output head to `chunk` tokens at a time (`core.head`), the reference view first, so per chunk only
  that chunk's reference log-probabilities and one view's logits exist: memory is bounded by chunk × V
  whatever the batch, and the reference is never stored whole;
- `score_tokens` (the `ppl` / `taylor` plan criteria, which already hold one model's logits) turns given
  logits into metrics a slice of positions at a time.

Both give the same numbers up to float round-off (tested).

`leading_agreement` turns top-1 agreements into the chat score's `prefix` (`data.run_chat`): per answer, the
agreements in a row from its first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.head import token_chunks


def next_token_targets(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, valid): the token each position predicts, and whether both it and its input are real."""
    return ids[:, 1:], (mask[:, 1:] * mask[:, :-1]).bool()


@dataclass
class TokenScores:
    """Per position ([batch, seq-1] from `score_tokens`; [valid tokens], in row-major order, from
    `score_hidden`): NLL of the target; with a reference, KL(reference ‖ model) in nats and whether the
    argmax agrees with the reference's. `logprobs`: the model's log-probability chunks when asked for (to
    serve as the reference of later models; `score_tokens` only). `prefix`: per scored sequence, the top-1
    agreements in a row from its first scored token (`leading_agreement`; the chat score only)."""

    nll: torch.Tensor
    kl: torch.Tensor | None = None
    top1: torch.Tensor | None = None
    logprobs: list[torch.Tensor] | None = None
    prefix: torch.Tensor | None = None


def leading_agreement(agree: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row of `valid` [batch, positions] that has a valid position: how many of its valid positions, from
    the first, agree before the first that does not. `agree`: 1-D over the valid positions in row-major order
    (`score_hidden`'s top-1)."""
    grid = torch.ones(valid.shape, dtype=agree.dtype, device=agree.device)
    grid[valid] = agree
    run = grid.cumprod(dim=1) * valid  # 1 until the first disagreement; positions that are not valid do not count
    return run.sum(dim=1)[valid.any(dim=1)]


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


@torch.no_grad()
def score_hidden(
    hidden: dict[str, torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor] | dict[str, Callable[[torch.Tensor], torch.Tensor]],
    targets: torch.Tensor,
    valid: torch.Tensor,
    *,
    reference: str | None = None,
    chunk: int = 1024,
    reference_logp: list[torch.Tensor] | None = None,
) -> dict[str, TokenScores]:
    """Metrics of every view from its final hidden states, `chunk` tokens at a time.

    `hidden`: view → final hidden states [batch, seq-1, C] at the positions that predict `targets` [batch, seq-1];
    only the `valid` positions are scored. `head`: hidden → logits (`core.head.output_head`), or one per view (views
    with their own head). `reference`: the view (a key of `hidden`) the others are compared with (KL and top-1); its
    own scores have none. `reference_logp`: the reference's log-probabilities per chunk, kept from
    `reference_log_probs` (with the same `valid` and `chunk`), so that a reference scored against many views runs
    its head once. Returns per view 1-D scores over the valid tokens (no gradients: evaluation only).
    """
    if reference_logp is not None and reference is not None and reference not in hidden:
        hidden = {reference: None, **hidden}
    if reference is not None and reference not in hidden:
        raise ValueError(f"reference view {reference!r} is not among the scored views {list(hidden)}")
    y = targets[valid]
    heads = head if isinstance(head, dict) else dict.fromkeys(hidden, head)
    flat = {view: h[valid] for view, h in hidden.items() if h is not None}
    order = [reference, *(v for v in flat if v != reference)] if reference is not None else list(flat)
    # Per view its chunks of NLL and, compared with the reference, of KL and top-1.
    parts: dict[str, dict[str, list[torch.Tensor]]] = {
        v: {k: [] for k in ("nll", "kl", "top1") if k == "nll" or reference not in (None, v)} for v in order
    }
    for k, part in enumerate(token_chunks(y.shape[0], chunk)):
        ref_logp = ref_p = ref_top = None
        for view in order:
            if view == reference and reference_logp is not None:
                logp = reference_logp[k]  # read only: the in-place KL below changes the other views' logp
            else:
                logp = _log_softmax_(heads[view](flat[view][part]))
            out = parts[view]
            out["nll"].append(-logp.gather(-1, y[part, None]).squeeze(-1))
            if view == reference:
                ref_logp, ref_p, ref_top = logp, logp.exp(), logp.argmax(-1)
            elif ref_logp is not None:
                out["top1"].append((ref_top == logp.argmax(-1)).float())
                # KL = Σ q (log q − log p), in place: one more [chunk, V] buffer, not three.
                out["kl"].append(logp.neg_().add_(ref_logp).mul_(ref_p).sum(-1))
            del logp
    empty = y.new_zeros(0, dtype=torch.float32)
    return {v: TokenScores(**{k: torch.cat(c) if c else empty for k, c in out.items()}) for v, out in parts.items()}


@torch.no_grad()
def reference_log_probs(
    hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], valid: torch.Tensor, chunk: int = 1024
) -> list[torch.Tensor]:
    """The float32 log-probabilities of one view at the `valid` positions, per chunk of `score_hidden`:
    what its `reference_logp` takes."""
    flat = hidden[valid]
    return [_log_softmax_(head(flat[part])) for part in token_chunks(flat.shape[0], chunk)]


def _log_softmax_(logits: torch.Tensor) -> torch.Tensor:
    """Float32 log-softmax over the last axis, in place when the logits already are float32."""
    logits = logits.float()
    return logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))


def next_token_nll(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL (float32, differentiable) over positions whose token and target are both
    real, and how many there are. `logits` are the model's output for `ids` (all positions)."""
    targets, valid = next_token_targets(ids, mask)
    step = max(1, chunk_tokens // max(1, ids.shape[0]))
    scores = score_tokens(logits[:, :-1], targets, chunk=step)
    return torch.where(valid, scores.nll, 0.0).sum(), int(valid.sum())
