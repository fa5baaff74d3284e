"""Every window through one block before the next: the passes of a model whose weights are off the device.

llm-compressor's sequential pipeline. `capture` records what the decoder hands each block for every batch
(the residual stream entering the first block; per block the keyword arguments: attention mask, rotary
position embeddings, position ids), by running the decoder with placeholder blocks that record and return
their input, so no block computes and a family whose blocks take different masks (sliding-window layers)
gets each its own. Then `advance` runs each block over every batch, keeping the activations, and a block is
brought onto the device once per pass (`core.offload.onloaded`), not once per batch:

    windows = capture(model, stack, batches)
    dense, ghost = view_stream(pruned, DENSE, windows), view_stream(pruned, "ghost", windows)
    taps, mlp = advance([dense, ghost], [stop_dense, stop_ghost], taps=[{4}, {3}])

A block computes exactly what it computes inside the model's forward (the same inputs, the same batch
shapes), so statistics, operators and scores are those of full forwards to the bit (tests/core/test_offload.py).

Several streams (views of one `PrunedModel`) advance together: at each dense block index the streams that
run it go through it in turn while it is on the device (a view's own copy of a block is a module of its
own). The views' operator hooks act as in a forward: the pruned model is switched to a stream's view for its
turn. A tap at position p is the input of block p as the block sees it, after its forward pre-hooks (the
operator a view puts at a gap), as `core.capture.residual_streams` takes it; position len(blocks) is the
output of the last block.

The offloaded executor (`core.executor.Offloaded`) is written on these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from contextlib import suppress
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from .capture import _StopForward
from .head import decoder_of
from .model import DecoderStack, decoder_stack, mlp_module, model_inputs
from .offload import onloaded
from .operator import first_position_mask
from .views import DENSE

Batch = dict[str, torch.Tensor]
Progress = Callable[[Sequence[int], str], Sequence[int]]


@dataclass
class Windows:
    """Batches at the input of the first block: per batch the token ids, the attention mask, the residual
    stream entering block 0, the first-position mask, and per dense block what the decoder passes it."""

    ids: list[torch.Tensor]
    masks: list[torch.Tensor]
    hidden: list[torch.Tensor]
    first: list[torch.Tensor]
    calls: list[list[tuple[tuple, dict]]]  # batch → dense block → (args after the stream, kwargs)
    offset: int = 0  # the caller's index of the first batch


class _Recorder(nn.Module):
    def __init__(self, index: int, last: int, calls: list) -> None:
        super().__init__()
        self.index, self.last, self.calls = index, last, calls

    def forward(self, hidden_states, *args, **kwargs):
        self.calls.append((hidden_states, args, kwargs))
        if self.index == self.last:
            raise _StopForward
        return hidden_states


@torch.no_grad()
def capture(model: nn.Module, stack: DecoderStack, batches: Sequence[Batch]) -> Windows:
    """`batches` at the input of the first block of `stack` (the model's current blocks), each block's
    arguments recorded; only the embedding runs (brought onto the device once for all batches)."""
    layers = stack.layers
    n = len(layers)
    windows = Windows([], [], [], [], [])
    with onloaded(model.get_input_embeddings()):
        for batch in batches:
            ids, mask = model_inputs(model, batch)
            calls: list = []
            stack.set_layers([_Recorder(i, n - 1, calls) for i in range(n)])
            try:
                with suppress(_StopForward):
                    decoder_of(model)(input_ids=ids, attention_mask=mask, use_cache=False)
            finally:
                setattr(stack.owner, stack.attr, layers)
            if len(calls) != n:
                raise RuntimeError(f"the decoder called {len(calls)} of its {n} blocks; cannot run it block by block")
            hidden = calls[0][0]
            windows.ids.append(ids)
            windows.masks.append(mask)
            windows.hidden.append(hidden)
            windows.first.append(first_position_mask(calls[0][2].get("position_ids"), hidden))
            windows.calls.append([(args, kwargs) for _, args, kwargs in calls])
    return windows


@dataclass
class Stream:
    """One view's activations of every window: `hidden[b]` enters the view's block `at`. `blocks`: the view's
    blocks in order, as (dense index, module). `seconds`: time spent running its blocks."""

    view: str | None
    blocks: list[tuple[int, nn.Module]]
    hidden: list[torch.Tensor]
    at: int = 0
    pruned: object = None
    seconds: float = 0.0


def view_stream(pruned, view: str, windows: Windows, at: int | None = None, prefix: Sequence[dict] = ()) -> Stream:
    """The stream of `view` of `pruned` (a `core.views.PrunedModel`): the windows at block 0, or, with `at`,
    entering its block `at` with `prefix[b][at]` for batch b of the windows."""
    indices = range(pruned.plan.num_layers) if view == DENSE else pruned.plan.kept
    with pruned.use(view):
        blocks = list(zip(indices, pruned.stack.layers))
    hidden = windows.hidden if at is None else [p[at] for p in prefix]
    return Stream(view, blocks, list(hidden), at or 0, pruned)


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _record(store: list, stop: bool, module, args, kwargs) -> None:
    """A block's forward pre-hook (bound by `partial`): its input into `store`; `stop`: then stop the forward."""
    store.append(args[0] if args else kwargs["hidden_states"])
    if stop:
        raise _StopForward


@torch.no_grad()
def _run(stream: Stream, windows: Windows, tap: list | None, mlp: list | None, peek: bool = False) -> None:
    """Stream's block `at` over every batch (the caller has it on the device). `peek`: only record into `tap`
    the block's input as the block sees it (after its pre-hooks), without running it."""
    index, block = stream.blocks[stream.at]
    if stream.pruned is not None and stream.pruned.view != stream.view:
        stream.pruned.set_view(stream.view)
    handles = []
    if tap is not None:
        handles.append(block.register_forward_pre_hook(partial(_record, tap, peek), with_kwargs=True))
    if mlp is not None:
        handles.append(mlp_module(block).register_forward_hook(lambda _module, _args, out: mlp.append(_output(out))))
    start = time.perf_counter()
    try:
        for b, hidden in enumerate(stream.hidden):
            args, kwargs = windows.calls[b][index]
            with suppress(_StopForward):  # a peek: the hook took the input and stopped the block
                stream.hidden[b] = _output(block(hidden, *args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    if not peek:
        stream.seconds += time.perf_counter() - start
        stream.at += 1


def advance(
    streams: Sequence[Stream],
    stops: Sequence[int],
    windows: Windows,
    *,
    taps: Sequence[Collection[int]] | None = None,
    mlp: Sequence[Collection[int]] | None = None,
    progress: Progress | None = None,
    desc: str = "block by block",
) -> tuple[list[dict[int, list[torch.Tensor]]], list[dict[int, list[torch.Tensor]]]]:
    """Run every stream up to the input of its block `stops[i]`, block by block, each dense block on the
    device once. Returns per stream the taps (position → per-batch tensors: the input of that block after its
    pre-hooks; len(blocks): the last block's output) and the MLP outputs of the blocks at `mlp` positions."""
    taps = taps or [()] * len(streams)
    mlp = mlp or [()] * len(streams)
    tapped: list[dict[int, list[torch.Tensor]]] = [{} for _ in streams]
    mlp_out: list[dict[int, list[torch.Tensor]]] = [{} for _ in streams]
    views = {id(s.pruned): (s.pruned, s.pruned.view, s.pruned.skip) for s in streams if s.pruned is not None}
    order = sorted({s.blocks[p][0] for s, stop in zip(streams, stops) for p in range(s.at, stop)})
    try:
        for dense_index in progress(order, desc) if progress is not None else order:
            group = [i for i, s in enumerate(streams) if s.at < stops[i] and s.blocks[s.at][0] == dense_index]
            modules = list({id(m): m for m in (streams[i].blocks[streams[i].at][1] for i in group)}.values())
            with onloaded(*modules):
                for i in group:
                    s = streams[i]
                    tap = tapped[i].setdefault(s.at, []) if s.at in taps[i] else None
                    out = mlp_out[i].setdefault(s.at, []) if s.at in mlp[i] else None
                    _run(s, windows, tap, out)
        for i, s in enumerate(streams):
            if s.at == len(s.blocks) and s.at in taps[i]:
                tapped[i][s.at] = list(s.hidden)
            elif s.at in taps[i]:
                _run(s, windows, tapped[i].setdefault(s.at, []), None, peek=True)
    finally:
        for pruned, view, skip in views.values():
            pruned.set_view(view, skip)
    return tapped, mlp_out


@torch.no_grad()
def final_states(streams: Sequence[Stream], windows: Windows) -> list[list]:
    """Each stream (of a view: `view_stream`) run to the end of its view and through its final norm: per stream
    the final hidden states of every batch (what the decoder's forward returns)."""
    advance(streams, [len(s.blocks) for s in streams], windows)
    out = []
    for s in streams:
        with s.pruned.use(s.view) as model:
            norm = decoder_stack(model).norm  # the view's own (a student that trains the tail has its own)
        if norm is None:
            raise TypeError(f"cannot find the final norm of {type(model).__name__}: it cannot run block by block")
        with onloaded(norm):
            out.append([norm(h) for h in s.hidden])
    return out
