"""The executors give the same streams, MLP outputs and final states to the bit (`core.executor`).

Both executors run here on one model in memory (the block-by-block one's `onloaded` is then a no-op), so the
comparison isolates the algorithm: one full forward per batch against every batch through one block before
the next. tests/core/test_offload.py runs every phase with the weights really offloaded."""

from __future__ import annotations

import pytest
import torch
from conftest import random_batches, tiny_model

from ghostdistill.core.executor import Executor, Offloaded, executor_of, gap_pairs
from ghostdistill.core.model import decoder_stack
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import DENSE, PRUNED, PrunedModel


def executors(model):
    return Executor(), Offloaded("offloaded")


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_dense_points_are_the_same_to_the_bit_in_ascending_order_per_pass(family):
    model = tiny_model(family, num_layers=6)
    stack = decoder_stack(model)
    batches = random_batches(3, batch=2, seq=16, seed=1)
    got = {}
    for ex in executors(model):
        reached = list(ex.dense_points(model, stack, batches, [4, 1, 6], mlp_blocks=[0, 3]))
        per_pass = [p for _, p, _, _ in reached]
        # memory: one pass per batch, each 1, 4, 6; block by block: one pass over all batches
        assert per_pass == ([1, 4, 6] * 3 if not ex.blockwise else [1, 4, 6])
        streams = {(w.offset + b, p): s for w, p, ss, _ in reached for b, s in enumerate(ss)}
        mlp = {
            (w.offset + b, k): o for w, p, _, m in reached if p == 6 for k, os in m.items() for b, o in enumerate(os)
        }
        got[ex.blockwise] = streams, mlp
    assert got[False][0].keys() == {(b, p) for b in range(3) for p in (1, 4, 6)}
    assert got[False][1].keys() == {(b, k) for b in range(3) for k in (0, 3)}
    for key, s in got[False][0].items():
        assert torch.equal(s, got[True][0][key]), key
    for key, s in got[False][1].items():
        assert torch.equal(s, got[True][1][key]), key


@torch.no_grad()
def test_gap_pairs_hold_a_stream_only_while_a_pair_needs_it():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    batches = random_batches(2, batch=2, seq=8)
    ref = [model(b["input_ids"], output_hidden_states=True).hidden_states for b in batches]
    for ex in executors(model):
        seen, pairs = [], [(1, 3), (3, 5)]
        for windows, k, before, after, _ in gap_pairs(ex.dense_points(model, stack, batches, [1, 3, 5]), pairs):
            i, j = pairs[k]
            for b, (x, y) in enumerate(zip(before, after)):
                seen.append((windows.offset + b, i, j))
                torch.testing.assert_close(x, ref[windows.offset + b][i])
                torch.testing.assert_close(y, ref[windows.offset + b][j])
        assert sorted(seen) == [(b, i, j) for b in range(2) for i, j in [(1, 3), (3, 5)]]


@torch.no_grad()
def test_view_points_and_view_finals_are_the_same_to_the_bit():
    model = tiny_model("qwen2", num_layers=6)
    pruned = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    batches = random_batches(3, batch=2, seq=16, seed=2)
    runs = [(DENSE, 4, []), (PRUNED, 2, [1])]  # the pruned view's block 2 is dense block 4
    points, finals = {}, {}
    for ex in executors(model):
        points[ex.blockwise] = {
            (w.offset + b, r): (t[r][b], {k: o[b] for k, o in m[r].items()})
            for w, t, m, seconds in ex.view_points(pruned, batches, runs)
            for r in range(len(runs))
            for b in range(len(t[r]))
        }
        finals[ex.blockwise] = {
            (w.offset + b, v): h[b]
            for w, hs in ex.view_finals(pruned, batches, [DENSE, PRUNED])
            for v, h in hs.items()
            for b in range(len(h))
        }
    assert len(points[False]) == 6 and len(finals[False]) == 6
    for key, (stream, mlp) in points[False].items():
        assert torch.equal(stream, points[True][key][0]), key
        assert mlp.keys() == points[True][key][1].keys() == ({1} if key[1] == 1 else set())
        for k in mlp:
            assert torch.equal(mlp[k], points[True][key][1][k])
    for key, h in finals[False].items():
        assert torch.equal(h, finals[True][key]), key
    with pruned.use(PRUNED) as m:
        torch.testing.assert_close(finals[False][(1, PRUNED)], m.model(batches[1]["input_ids"]).last_hidden_state)


@torch.no_grad()
def test_view_finals_from_a_kept_dense_stream_are_the_full_forwards_and_the_same_to_the_bit():
    model = tiny_model("llama", num_layers=6)
    pruned = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    batches = random_batches(2, batch=2, seq=16, seed=3)
    stack = decoder_stack(model)
    prefix = [{2: s[0]} for _, _, s, _ in Executor().dense_points(model, stack, batches, [2])]
    started = {}
    for ex in executors(model):  # the pruned view from the dense stream entering its block 2 (the gap's start)
        started[ex.blockwise] = [
            h[PRUNED][0] for _, h in ex.view_finals(pruned, batches[:1], [PRUNED], {PRUNED: 2}, prefix)
        ]
        started[ex.blockwise] += [
            h[PRUNED][0] for _, h in ex.view_finals(pruned, batches[1:], [PRUNED], {PRUNED: 2}, prefix[1:])
        ]
    full = [h[PRUNED][0] for _, h in Executor().view_finals(pruned, batches, [PRUNED])]
    for b in range(2):
        assert torch.equal(started[False][b], started[True][b]), b
        torch.testing.assert_close(started[False][b], full[b])
    for ex in executors(model):  # the kept stream is what the view starts from, not the embeddings
        moved = next(ex.view_finals(pruned, batches[:1], [PRUNED], {PRUNED: 2}, [{2: prefix[0][2] + 1}]))[1]
        assert not torch.allclose(moved[PRUNED][0], full[0])


def test_the_executor_of_a_model_follows_how_it_was_loaded():
    model = tiny_model("llama", num_layers=2)
    assert executor_of(model).mode == "memory" and not executor_of(model).streamed
    model.ghostdistill_offload = "cpu"  # what core.offload marks on a model it offloads
    model.ghostdistill_device = "cpu"
    ex = executor_of(model)
    assert isinstance(ex, Offloaded) and ex.blockwise and ex.streamed and ex.mode == "offloaded"
