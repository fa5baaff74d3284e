"""KL(dense ‖ candidate) on the selection windows, the dense side computed once for every candidate.

A candidate whose first gap starts at block i runs the dense model's blocks 0 … i−1 unchanged, so the
dense pass also keeps the residual stream entering each candidate start and a candidate's forward starts
there (`PrunedModel.use(view, skip=i)` with the stream as input embeddings): only the blocks after the
gap run. A view that also changes the block before the gap (ReplaceMe's map on its MLP output) starts one
block earlier, at the stream entering block i − 1, which the dense pass keeps too. The shortcut is checked
once against a full forward and turned off (with a warning) for a family that transforms its input
embeddings, as the distillation students' shared prefix is.

Both passes are the model's executor's (`core.executor`: `dense_points`, then `view_finals` from the kept
streams): a forward per window batch, or with the weights offloaded every view advancing block by block over
all the windows together, each block and the head brought onto the device once; both score the same to the bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..core.executor import executor_of
from ..core.head import output_head, tokens_per_chunk
from ..core.model import decoder_stack, model_inputs
from ..core.offload import onloaded
from ..core.views import DENSE, PrunedModel
from ..evaluation.metrics import next_token_targets, reference_log_probs, score_hidden
from .interface import Batch

# The dense log-probabilities over the selection tokens are kept (its head then runs once, not once per
# candidate) when they take at most this many bytes: 8 × 511 tokens at a 49k vocabulary are 0.75 GiB.
DENSE_LOGP_BYTES = 1.5 * 2**30


class SelectionScorer:
    """Scores views of candidate plans against the dense model on fixed held-out windows.

    At construction (the model dense) the dense model's final hidden states are computed and kept,
    [windows, seq, C] in the model's dtype, with the residual stream entering every block of `starts`
    (memory: windows × seq × C per start), and the dense log-probabilities when they fit in
    `DENSE_LOGP_BYTES`. Each `score` runs the candidate's views and compares their next-token
    distributions with the dense one chunk by chunk (`evaluation.metrics.score_hidden`), so no candidate's
    [batch, seq, vocab] tensor is ever held."""

    def __init__(self, model: nn.Module, batches: Sequence[Batch], starts: Sequence[int] = ()) -> None:
        if not batches:
            raise ValueError("the selection windows are empty")
        self.model = model
        self.inputs = [model_inputs(model, b) for b in batches]
        vocab = model.get_output_embeddings().weight.shape[0]
        self.chunk = tokens_per_chunk(vocab)
        # Each start i and i − 1: a view with an MLP map acts inside block i − 1 (`_first_block`).
        self.starts = sorted({j for i in starts if i > 0 for j in (int(i), int(i) - 1) if j > 0})
        stack = decoder_stack(model)
        if stack.norm is None:
            raise TypeError(f"cannot find the final norm of {type(model).__name__}: its candidates cannot be scored")
        self.dense: list[torch.Tensor] = []
        self.prefix: list[dict[int, torch.Tensor]] = [{} for _ in batches]
        self.batches = list(batches)
        executor = executor_of(model)
        with torch.no_grad(), onloaded(stack.norm):
            n = len(stack.layers)
            for windows, point, streams, _ in executor.dense_points(model, stack, batches, [*self.starts, n]):
                for b, stream in enumerate(streams, start=windows.offset):
                    if point == n:
                        self.dense.append(stack.norm(stream)[:, :-1])
                    else:
                        self.prefix[b][point] = stream
        self.tokens = sum(int(next_token_targets(ids, mask)[1].sum()) for ids, mask in self.inputs)
        self.dense_logp: list[list[torch.Tensor]] | None = None
        if self.tokens * vocab * 4 <= DENSE_LOGP_BYTES:
            head = output_head(model)
            with onloaded(model.get_output_embeddings()):
                self.dense_logp = [
                    reference_log_probs(dense, head, next_token_targets(ids, mask)[1], self.chunk)
                    for dense, (ids, mask) in zip(self.dense, self.inputs)
                ]
        self.forwards = 0  # candidate forwards over all the selection windows
        self.skip = bool(self.starts)  # until the first check says otherwise
        # Block by block a view enters its first block with the kept stream itself, which no embedding transform
        # touches: nothing to check, and the check would cost two more passes over the offloaded weights.
        self._checked = executor.blockwise

    @staticmethod
    def _first_block(pruned: PrunedModel, view: str, start: int) -> int:
        """The first block `view` runs differently from the dense model, for a candidate whose first gap
        starts at `start`: the block before the gap when the view maps that block's MLP output (ReplaceMe),
        else the first block after the gap (entered by the dense stream at `start`)."""
        return start - 1 if view in pruned.mlp_maps and len(pruned.mlp_maps[view]) else start

    def _finals(self, pruned: PrunedModel, views: Sequence[str], start: int | None, batches=None) -> Iterator:
        """The views' final hidden states per pass of the executor, each view started at the candidate's first
        block where that stream was kept (`start` None: every view from its embeddings)."""
        starts = {}
        if start is not None and self.skip:
            starts = {v: f for v in views if (f := self._first_block(pruned, v, start)) in self.prefix[0]}
        batches = self.batches if batches is None else batches
        return executor_of(self.model).view_finals(pruned, batches, views, starts, self.prefix)

    def _check(self, pruned: PrunedModel, view: str, start: int) -> None:
        (_, full), (_, short) = (next(self._finals(pruned, [view], s, self.batches[:1])) for s in (None, start))
        full, short = full[view][0], short[view][0]
        tol = 1e-4 if full.dtype == torch.float32 else 2e-2
        if not torch.allclose(full.float(), short.float(), atol=tol, rtol=tol):
            warnings.warn(
                f"{type(self.model).__name__}: starting a candidate at its first gap does not reproduce its full "
                "forward (the family transforms its input embeddings); scoring every candidate with full forwards",
                stacklevel=3,
            )
            self.skip = False
        self._checked = True

    @torch.no_grad()
    def score(self, pruned: PrunedModel, views: Sequence[str], start: int | None = None) -> dict[str, dict[str, float]]:
        """Per view: mean KL(dense ‖ view) in nats and top-1 agreement over the selection tokens. `start`:
        the first removed block of the candidate (its forward starts there when that stream was kept)."""
        if start is not None and self.skip and not self._checked and start in self.prefix[0]:
            self._check(pruned, views[0], start)
        head = output_head(self.model)
        sums = {v: [0.0, 0.0] for v in views}
        with onloaded(self.model.get_output_embeddings()):
            for windows, finals in self._finals(pruned, views, start):
                for b, states in enumerate(zip(*(finals[v] for v in views)), start=windows.offset):
                    targets, valid = next_token_targets(*self.inputs[b])
                    kept = self.dense_logp[b] if self.dense_logp is not None else None
                    hidden = {DENSE: self.dense[b], **{v: h[:, :-1] for v, h in zip(views, states)}}
                    scores = score_hidden(
                        hidden, head, targets, valid, reference=DENSE, chunk=self.chunk, reference_logp=kept
                    )
                    for view in views:
                        sums[view][0] += float(scores[view].kl.double().sum())
                        sums[view][1] += float(scores[view].top1.double().sum())
        self.forwards += len(views)
        n = max(self.tokens, 1)
        return {v: {"kl": kl / n, "top1": top1 / n} for v, (kl, top1) in sums.items()}
