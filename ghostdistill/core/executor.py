"""How a phase's passes run on the model as it is held: in memory, FSDP2-sharded, or offloaded.

A phase says what it needs ("the dense residual stream at these block boundaries, for these windows"), and
the model's executor (`executor_of`) decides how the windows go through the blocks:

    executor = executor_of(model)
    for windows, point, streams, mlp in executor.dense_points(model, stack, batches, points, mlp_blocks):
        ...  # streams[b]: the stream entering block `point` for batch windows.offset + b

- ``memory``: one batch at a time, a full forward per batch that stops at the last point asked for
  (`core.capture.residual_streams`); one batch's activations are held.
- ``sharded`` (FSDP2): the same forwards, every rank in lockstep; each block gathers its shards for its turn.
- ``offloaded`` (`core.offload`): every batch through one block before the next (`core.sequential`), so each
  block is read once per pass, not once per batch; the streams of all batches at a point are held together.

The points of one pass come in ascending order, and each arrives with the MLP outputs the pass has gone
through, so a consumer written once (keep the stream at a gap's start, use it when its end arrives) is right
under every executor, and the numbers are the same to the bit whichever executor runs them (why: `core.sequential`;
tests/core/test_executor.py, tests/core/test_offload.py).

Whole-pass executors (`blockwise`) finish a phase's sums only at the end of their single pass: a phase
checkpoints them then, and defers per-batch work until all batches are there (`Run.score_batch`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Sequence

import torch
from torch import nn

from .capture import residual_streams
from .head import final_hidden
from .model import DecoderStack, model_inputs
from .offload import is_offloaded
from .sequential import Batch, Progress, Stream, Windows, advance, capture, final_states, view_stream
from .sharded import is_sharded
from .views import DENSE

# The most bytes of final hidden states one block-by-block evaluation pass holds (each pass reads the weights once).
PASS_BYTES = 4 * 2**30
# (windows of the pass, block boundary, per-batch streams there, block → per-batch MLP outputs so far)
Reached = tuple[Windows, int, list[torch.Tensor], dict[int, list[torch.Tensor]]]
Run = tuple[str, int, Sequence[int]]  # (view, block point, MLP blocks)
Finals = tuple[Windows, dict[str, list[torch.Tensor]]]  # (windows, view → per-batch final hidden states)
# (windows, per run the per-batch streams, per run block → per-batch MLP outputs, per run seconds)
Views = tuple[Windows, list[list[torch.Tensor]], list[dict[int, list[torch.Tensor]]], list[float]]


class Executor:
    """Full forwards, one batch at a time (the model's weights on its device, whole or sharded)."""

    blockwise = False

    def __init__(self, mode: str = "memory") -> None:
        self.mode = mode

    def passes(self, batches: Sequence[Batch], start: int = 0) -> list[tuple[int, list[Batch]]]:
        """The batches as this executor's passes go through them: (index of the first, batches); one each here,
        so that a phase may checkpoint its sums between passes."""
        return [(start + i, [b]) for i, b in enumerate(batches)]

    @property
    def streamed(self) -> bool:
        """Whether the weights are never whole on one device (export reads them block by block)."""
        return self.mode != "memory"

    @torch.no_grad()
    def dense_points(
        self,
        model: nn.Module,
        stack: DecoderStack,
        batches: Iterable[Batch],
        points: Collection[int],
        mlp_blocks: Collection[int] = (),
        progress: Progress | None = None,
        desc: str = "",
    ) -> Iterator[Reached]:
        """The dense streams entering each block of `points` (len(blocks): the last block's output), in
        ascending order per pass, with the MLP outputs of the `mlp_blocks` passed so far. Here a pass is
        one batch (`progress` is the caller's: it walks the batches)."""
        order = sorted(set(points))
        for index, batch in enumerate(batches):
            ids, mask = model_inputs(model, batch)
            mlp: dict[int, torch.Tensor] = {}
            streams, first = residual_streams(model, stack, ids, mask, order, sorted(mlp_blocks), mlp)
            windows = Windows([ids], [mask], [], [first], [], offset=index)
            outs = {block: [out] for block, out in mlp.items()}
            for point in order:
                yield windows, point, [streams[point]], outs

    @torch.no_grad()
    def view_points(self, pruned, batches: Iterable[Batch], runs: Sequence[Run], desc: str = "") -> Iterator[Views]:
        """Per run (`Run`) of `pruned` (a `core.views.PrunedModel`) the stream entering the view's block `point`
        and the MLP outputs of its `MLP blocks`, yielded per pass (`Views`)."""
        for index, batch in enumerate(batches):
            ids, mask = model_inputs(pruned.model, batch)
            taps, outs, seconds = [], [], []
            for view, point, mlp_blocks in runs:
                start = time.perf_counter()
                mlp: dict[int, torch.Tensor] = {}
                with pruned.use(view):
                    streams, first = residual_streams(pruned.model, pruned.stack, ids, mask, [point], mlp_blocks, mlp)
                taps.append([streams[point]])
                outs.append({block: [out] for block, out in mlp.items()})
                seconds.append(time.perf_counter() - start)
            yield Windows([ids], [mask], [], [first], [], offset=index), taps, outs, seconds

    @torch.no_grad()
    def view_finals(
        self, pruned, batches: Sequence[Batch], views: Sequence[str], starts=None, prefix=None
    ) -> Iterator[Finals]:
        """Every view's final hidden states (after its final norm, what its decoder returns), per pass (`Finals`).
        `starts[view]`, where given, is the block the view starts at from `prefix[b][block]`, the dense stream
        entering it for batch b (the blocks before it are the dense ones)."""
        for index, batch in enumerate(batches):
            ids, mask = model_inputs(pruned.model, batch)
            hidden = {}
            for view in views:
                first = (starts or {}).get(view)
                with pruned.use(view, skip=first or 0) as model:
                    embeds = None if first is None else prefix[index][first]
                    hidden[view] = [final_hidden(model, ids, mask, embeds)]
            yield Windows([ids], [mask], [], [], [], offset=index), hidden


class Offloaded(Executor):
    """Every batch through one block before the next, each block brought onto the device once per pass."""

    blockwise = True

    def passes(self, batches, start=0):
        """Every batch in one pass: its sums are complete only at its end."""
        return [(start, list(batches))] if len(batches) else []

    def dense_points(self, model, stack, batches, points, mlp_blocks=(), progress=None, desc="block by block"):
        """As `Executor.dense_points`, in one block-by-block pass over all `batches`: nothing is held beyond
        what the caller keeps."""
        windows = capture(model, stack, list(batches))
        stream = Stream(None, list(enumerate(stack.layers)), list(windows.hidden))  # through the current blocks
        mlp: dict[int, list[torch.Tensor]] = {}
        for point in sorted(set(points)):
            taps, outs = advance(
                [stream], [point], windows, taps=[{point}], mlp=[set(mlp_blocks)], progress=progress, desc=desc
            )
            mlp.update(outs[0])
            yield windows, point, taps[0][point], mlp

    @torch.no_grad()
    def view_points(self, pruned, batches, runs, desc=""):
        """As `Executor.view_points`, every run advancing together in one block-by-block pass."""
        start = time.perf_counter()
        with pruned.use(DENSE):
            windows = capture(pruned.model, pruned.stack, list(batches))
        streams = [view_stream(pruned, view, windows) for view, _, _ in runs]
        stops = [point for _, point, _ in runs]
        taps, mlp = advance(streams, stops, windows, taps=[{p} for p in stops], mlp=[m for *_, m in runs], desc=desc)
        seconds = [s.seconds for s in streams]
        seconds[0] += time.perf_counter() - start - sum(seconds)  # the capture and the onloads: the first run's
        yield windows, [t[p] for t, p in zip(taps, stops)], mlp, seconds

    @torch.no_grad()
    def view_finals(self, pruned, batches, views, starts=None, prefix=None):
        """As `Executor.view_finals`, every view advancing together block by block; the batches cut into
        passes that hold at most `PASS_BYTES` of final hidden states (each pass reads the weights once)."""
        model = pruned.model
        item = next(model.parameters()).element_size() * model.get_input_embeddings().weight.shape[1]
        per_batch = max(1, (len(views) + 1) * item * max(int(b["input_ids"].numel()) for b in batches))
        size = max(1, PASS_BYTES // per_batch)
        for lo in range(0, len(batches), size):
            with pruned.use(DENSE):
                windows = capture(model, pruned.stack, batches[lo : lo + size])
            windows.offset = lo
            kept = (prefix or [])[lo : lo + len(windows.ids)]  # the kept dense streams of this pass's batches
            streams = [view_stream(pruned, v, windows, (starts or {}).get(v), kept) for v in views]
            yield windows, dict(zip(views, final_states(streams, windows)))


def executor_of(model: nn.Module) -> Executor:
    """The executor of `model` as it is held now: offloaded (`core.offload`), FSDP2-sharded, or in memory."""
    if is_offloaded(model):
        return Offloaded("offloaded")
    return Executor("sharded" if is_sharded(model) else "memory")


def gap_pairs(
    reached: Iterable[Reached], pairs: Sequence[tuple[int, int]]
) -> Iterator[tuple[Windows, int, list[torch.Tensor], list[torch.Tensor], dict[int, list[torch.Tensor]]]]:
    """(windows, k, streams entering i, streams entering j, MLP outputs) for the k-th pair (i, j) of `pairs`
    once `reached` arrives at j; a stream is held only while a pair still needs it."""
    held: dict[int, list[torch.Tensor]] = {}
    for windows, point, streams, mlp in reached:
        held[point] = streams
        for k, (i, j) in enumerate(pairs):
            if j == point:
                yield windows, k, held[i], streams, mlp
        held = {p: s for p, s in held.items() if any(i == p and j > point for i, j in pairs)}
