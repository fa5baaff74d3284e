"""The output head applied to final hidden states, a chunk of tokens at a time.

A causal LM computes logits z = head(h) from the final hidden states h [batch, seq, C] (after the final
norm). Holding z for a whole batch costs batch·seq·V floats: 4 × 512 × 262,144 float32 logits are 2 GiB,
and their log-softmax as much again. Metrics and losses need z only token by token, so evaluation
(`evaluation.metrics.score_hidden`) and distillation (`distill.loss.chunked_distillation_loss`) both take
h from the decoder (`final_hidden`) and apply the head to `chunk` tokens at a time (`token_chunks`):
peak memory holds a few of one chunk's [chunk, V] buffers whatever the batch, and with the chunk sized by
the vocabulary (`tokens_per_chunk`: chunk·V ≈ 2^25) whatever the vocabulary too.

`output_head` reproduces what the model's own forward does after the decoder: the linear head, and
where the family has them, the logit scale (Cohere) and the final soft-cap z ← c·tanh(z/c) (Gemma 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder (embeddings, blocks, final norm) under the causal-LM head."""
    getter = getattr(model, "get_decoder", None)
    decoder = getter() if callable(getter) else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if not isinstance(decoder, nn.Module):
        raise TypeError(f"cannot find the decoder of {type(model).__name__} (no get_decoder() or .model)")
    return decoder


def final_hidden(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None, embeds: torch.Tensor | None = None
) -> torch.Tensor:
    """The final hidden states [batch, seq, C] (after the final norm), without computing any logits; from
    `embeds`, where given, in place of the embeddings of `ids` (the stream entering the model's first block)."""
    inputs = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
    return decoder_of(model)(**inputs, attention_mask=mask, use_cache=False).last_hidden_state


def output_head(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden [..., C] → logits [..., V] exactly as the model's forward turns its decoder output into logits."""
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output head (get_output_embeddings() is None)")
    config = getattr(model, "config", None)
    scale = getattr(config, "logit_scale", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale is None and cap is None:
        return head

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


# Logit elements per chunk when no chunk size is given: 2^25 float32 values = 128 MiB per [chunk, V] buffer.
CHUNK_ELEMENTS = 2**25


def tokens_per_chunk(vocab_size: int, chunk: int | None = None) -> int:
    """`chunk` when given; otherwise as many tokens as keep one chunk's logits at `CHUNK_ELEMENTS` values
    (1,024 tokens at a 32k vocabulary, 128 at 262k), so memory does not grow with the vocabulary. A given chunk
    is checked where it is set (`evaluation.logit_chunk`) and where it is used (`token_chunks`)."""
    return chunk if chunk is not None else max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def token_chunks(n: int, chunk: int) -> Iterator[slice]:
    """Slices of `chunk` consecutive tokens covering 0..n."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    for lo in range(0, n, chunk):
        yield slice(lo, min(lo + chunk, n))
