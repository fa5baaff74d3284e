"""Shortened LLaMA's PPL criterion (Kim et al. 2024): perplexity of the model without each single block."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..core.model import DecoderStack, model_inputs
from ..core.plan import PruningPlan
from ..core.views import PRUNED, PrunedModel
from ..evaluation.metrics import next_token_nll
from .candidates import PerBlock
from .interface import Batch, register


@torch.no_grad()
def removal_perplexity(
    model: nn.Module, stack: DecoderStack, batches: Iterable[Batch], blocks: list[int]
) -> dict[int, float]:
    """For each block, the perplexity on the batches of the model with only that block removed. One forward
    pass per block per batch; the model's layers, config and `layer_idx` are restored afterwards, even on error."""
    num_layers = len(stack.layers)
    views: dict[int, PrunedModel] = {}
    nll = {i: 0.0 for i in blocks}
    tokens = 0
    try:
        for i in blocks:
            views[i] = PrunedModel(model, PruningPlan.from_layers([i], num_layers, allow_edges=True))
        for batch in batches:
            ids, mask = model_inputs(model, batch)
            for i in blocks:
                with views[i].use(PRUNED) as pruned:
                    logits = pruned(input_ids=ids, attention_mask=mask, use_cache=False).logits
                total, count = next_token_nll(logits, ids, mask)
                nll[i] += float(total)
            tokens += count
    finally:
        # Each view hosts (inactive) operator hooks on the dense blocks: leave none behind.
        for view in views.values():
            view.remove_hooks()
    if tokens == 0:
        raise ValueError("the criterion saw no tokens: the calibration data is empty (or one token per window)")
    # Cap the exponent: a wrecked model's perplexity overflows a float, and the ranking only needs order.
    return {i: math.exp(min(nll[i] / tokens, 700.0)) for i in blocks}


register(PerBlock("ppl", removal_perplexity, costly=True))
