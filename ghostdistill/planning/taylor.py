"""Shortened LLaMA's Taylor criterion (Kim et al. 2024): Σ|W·∂L/∂W| over each block's parameters."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..core.model import DecoderStack, model_inputs
from ..evaluation.metrics import next_token_nll
from .candidates import PerBlock
from .interface import Batch, register


def taylor_importance(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """Importance of block i = sum over its parameters of |W * dL/dW|, L the mean next-token cross-entropy over
    every non-padding token of the batches (gradients accumulated over batches before the absolute value).

    Only the candidate blocks' parameters get gradients; every parameter's `requires_grad` and `.grad`
    and every module's training flag are put back afterwards, even on error."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError("the taylor criterion needs gradients; call it outside torch.inference_mode()")
    params = list(model.parameters())
    saved_flags = [p.requires_grad for p in params]
    saved_grads = [p.grad for p in params]
    saved_training = {m: m.training for m in model.modules()}
    # Parameters shared between blocks (rare) are counted once per block that uses them.
    block_params = {i: list(stack.layers[i].parameters()) for i in blocks}
    tokens = 0
    try:
        model.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        for i in blocks:
            stack.layers[i].requires_grad_(True)
        # Dropout would make the gradient noisy; the importance is of the inference-time model.
        model.eval()
        with torch.enable_grad():
            for batch in batches:
                ids, mask = model_inputs(model, batch)
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                total, count = next_token_nll(logits, ids, mask)
                del logits
                if count:
                    # Summed, not averaged per batch, so that every token weighs the same across batches.
                    total.backward()
                tokens += count
        if tokens == 0:
            raise ValueError("the criterion saw no tokens: the calibration data is empty (or one token per window)")
        with torch.no_grad():
            scores = {
                i: sum(
                    float((p.float() * p.grad.float()).abs().sum(dtype=torch.float64)) for p in ps if p.grad is not None
                )
                / tokens
                for i, ps in block_params.items()
            }
    finally:
        for p, flag, grad in zip(params, saved_flags, saved_grads):
            p.grad = grad
            p.requires_grad_(flag)
        for m, training in saved_training.items():
            m.training = training
    return scores


register(PerBlock("taylor", taylor_importance, costly=True))
