"""The loss against the teacher's cached top-k, fused with the output head: loss and gradient in one pass.

`loss.chunked_cached_loss` is the reference: autograd through the head and a log-softmax over the vocabulary,
each chunk inside activation checkpointing, so a chunk's head product and its vocabulary-wide arithmetic run
three times (forward, recompute, backward). Here the gradient is written down instead. With z the student's
logits at temperature τ, p = softmax(z), and the k + 1 outcomes o ∈ K ∪ {rest} of `loss.py` (P(o) a token's
probability, or the rest's mass), per token:

    forward KL(T ‖ S):  ∂/∂z_j = p_j (1 − P_T(o_j) / P_S(o_j))
    reverse KL(S ‖ T):  ∂/∂z_j = p_j (log P_S(o_j) − log P_T(o_j) − KL(S ‖ T))

(o_j: the outcome of token j; for j ∈ K the first is p_j − p_T,j), and with the τ² scale ∂/∂logits = τ ∂/∂z;
cross-entropy adds α (softmax(logits) − onehot(y)). So a chunk costs one head product for the logits, a few
passes over [chunk, vocab] (exp, one sum over the rest, one scale) and one product for the hidden states'
gradient (two with a trained head: `tail`), and its gradient is kept ([chunk, C]) for the backward, which
only scales it. The student's rest mass is summed over the rest's own probabilities, not 1 − Σ_K p (no
cancellation). Under bfloat16 autocast both products run in bfloat16 (the head cast once per call); the
vocabulary-wide arithmetic stays float32. Tested equal to the reference, values and gradients.
"""

from __future__ import annotations

import torch

from ..core.head import token_chunks
from .loss import LossConfig, cached_rows


def fusable(cfg: LossConfig, head) -> bool:
    """Whether `fused_cached_loss` covers this loss and head (a plain linear head; no `top_k` renormalisation,
    which the reference handles)."""
    return isinstance(head, torch.nn.Linear) and (cfg.top_k is None)


def _chunk(h, weight, bias, logp, index, log_tail, y, cfg: LossConfig, want_w: bool):
    """(loss sum, ∂/∂h, ∂/∂W or None, ∂/∂b or None) of one chunk of tokens."""
    tau, alpha = cfg.temperature, cfg.ce_weight
    logits = torch.nn.functional.linear(h.to(weight.dtype), weight, bias).float()
    z = logits / tau if tau != 1.0 else logits
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)  # the student's distribution at τ; becomes the gradient in place
    p_k = p.gather(-1, index)
    log_p_k = z.gather(-1, index) - lse
    p.scatter_(-1, index, 0.0)
    r_s = p.sum(-1)  # the student's mass off the teacher's tokens, summed over those tokens themselves
    has_t = log_tail > float("-inf")
    r_t = torch.where(has_t, log_tail, 0.0).exp() * has_t
    log_r_s, log_r_t = r_s.clamp_min(1e-30).log(), torch.where(has_t, log_tail, 0.0)
    t_k = logp.exp()
    grad_k, coef_rest, kd = torch.zeros_like(p_k), torch.zeros_like(r_s), torch.zeros_like(r_s)
    kinds = [k for k in ("forward", "reverse") if cfg.kind in (k, "symmetric")]
    for kind in kinds:
        if kind == "forward":
            kd = kd + (t_k * (logp - log_p_k)).sum(-1) + torch.where(has_t, r_t * (log_r_t - log_r_s), 0.0)
            grad_k = grad_k + (p_k - t_k)
            coef_rest = coef_rest + torch.where(r_s > 0, 1.0 - r_t / r_s.clamp_min(1e-30), 1.0)
        else:
            a_k, a_rest = log_p_k - logp, log_r_s - torch.where(has_t, log_r_t, -1e4)
            rev = (p_k * a_k).sum(-1) + torch.where(r_s > 0, r_s * a_rest, 0.0)
            kd = kd + rev
            grad_k = grad_k + p_k * (a_k - rev[:, None])
            coef_rest = coef_rest + torch.where(r_s > 0, a_rest - rev, 0.0)
    scale = tau / len(kinds)  # τ² · ∂z/∂logits (1/τ), averaged over the kinds
    loss = kd / len(kinds) * tau**2
    grad = p.mul_((coef_rest * scale)[:, None])
    grad.scatter_(-1, index, grad_k * scale)
    if alpha > 0:
        if y is None:
            raise ValueError("ce_weight > 0 needs the labels")
        grad.mul_(1.0 - alpha)
        log_q = torch.log_softmax(logits, dim=-1)  # CE is at temperature 1
        loss = (1.0 - alpha) * loss - alpha * log_q.gather(-1, y[:, None]).squeeze(-1)
        grad.add_(log_q.exp_(), alpha=alpha)
        grad.scatter_add_(-1, y[:, None], torch.full_like(y[:, None], -alpha, dtype=grad.dtype))
    g = grad.to(weight.dtype)
    grad_h = (g @ weight).to(h.dtype)
    grad_w = (g.t() @ h.to(weight.dtype)).float() if want_w else None
    grad_b = grad.sum(0) if want_w and bias is not None else None
    return loss.sum(), grad_h, grad_w, grad_b


class _FusedCachedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, logp, index, log_tail, y, cfg, compute_dtype):
        want_w = weight.requires_grad
        w = weight.to(compute_dtype) if compute_dtype is not None else weight
        b = bias.to(compute_dtype) if bias is not None and compute_dtype is not None else bias
        total = h.new_zeros((), dtype=torch.float32)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_w and bias is not None else None
        with torch.autocast(h.device.type, enabled=False):
            for part in token_chunks(h.shape[0], cfg.chunk_tokens):
                y_part = y[part] if y is not None else None
                loss, gh, gw, gb = _chunk(
                    h[part], w, b, logp[part].float(), index[part], log_tail[part].float(), y_part, cfg, want_w
                )
                total = total + loss
                grad_h[part] = gh
                if gw is not None:
                    grad_w += gw
                if gb is not None:
                    grad_b += gb
        ctx.save_for_backward(grad_h, grad_w, grad_b)  # None where the head's weight or bias takes none
        ctx.dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, *grad_wb = ctx.saved_tensors
        grad_w, grad_b = ((g * grad_out).to(ctx.dtype) if g is not None else None for g in grad_wb)
        return grad_h * grad_out, grad_w, grad_b, None, None, None, None, None, None


def fused_cached_loss(
    student_hidden: torch.Tensor,
    head: torch.nn.Linear,
    valid: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: LossConfig,
) -> torch.Tensor:
    """`loss.chunked_cached_loss` (same arguments, a linear `head`), its gradient computed in the forward pass."""
    s, (logp, index, tail), y = cached_rows(student_hidden, valid, targets, teacher)
    n = s.shape[0]
    if n == 0:
        return student_hidden.sum() * 0.0
    device = s.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return _FusedCachedLoss.apply(s, head.weight, head.bias, logp, index, tail, y, cfg, dtype) / n
