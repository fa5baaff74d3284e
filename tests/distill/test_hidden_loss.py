"""The hidden-state term of the distillation loss: the chunked computation equals the plain formula, gradients
included, and the streams it compares are the residual streams entering the first block after each gap."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_all, tiny_model

from ghostdistill.core.head import output_head
from ghostdistill.core.plan import PruningPlan
from ghostdistill.distill.config import DistillConfig, StudentConfig
from ghostdistill.distill.loss import LossConfig, chunked_distillation_loss, hidden_positions, hidden_state_loss
from ghostdistill.evaluation.metrics import next_token_targets
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.train import build_students, distill_step


@pytest.mark.parametrize("kind", ["mse", "cosine"])
@pytest.mark.parametrize("first", [False, True])
def test_the_chunked_term_equals_the_plain_formula_and_its_gradients(kind, first):
    torch.manual_seed(0)
    b, t, c = 3, 7, 5
    student = [torch.randn(b, t, c, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    teacher = [torch.randn(b, t, c, dtype=torch.float64) for _ in range(2)]
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 5:] = 0  # padding
    valid = hidden_positions(mask, first)
    assert bool(valid[0, 0]) is first and not valid[1, 5:].any()

    got = hidden_state_loss(student, teacher, valid, kind, chunk_tokens=4)  # several chunks, one partial
    got.backward()
    grads = [s.grad.clone() for s in student]
    for s in student:
        s.grad = None

    # The plain formula, position by position.
    terms = []
    for s, tt in zip(student, teacher):
        per = []
        for i in range(b):
            for j in range(t):
                if not valid[i, j]:
                    continue
                x, y = s[i, j], tt[i, j]
                if kind == "mse":
                    per.append(((x - y) ** 2).sum() / c)
                else:
                    per.append(1 - (x @ y) / (x.norm() * y.norm()))
        terms.append(torch.stack(per).mean())
    want = torch.stack(terms).mean()
    want.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    for g, s in zip(grads, student):
        torch.testing.assert_close(g, s.grad, rtol=1e-5, atol=1e-7)


def _hooked_streams(model, layers, gap_sites, ids):
    """The input of each listed block (None: the final norm) in a plain forward of `model`."""
    got = {}
    handles = []
    for k, i in enumerate(gap_sites):
        module = model.model.norm if i is None else layers[i]
        handles.append(module.register_forward_pre_hook(lambda m, a, k=k: got.__setitem__(k, a[0])))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return [got[k] for k in range(len(gap_sites))]


def test_the_streams_are_the_residual_stream_after_each_gap():
    model = tiny_model("llama", 6)
    plan = PruningPlan.from_layers([1, 2, 5], 6, allow_edges=True)  # a gap inside, and one at the end
    pm, _ = fit_all(model, plan, [RecoveryConfig(name="ghost")])
    loss = LossConfig(hidden_weight=1.0)
    cfg = DistillConfig(students=[StudentConfig(name="ghost_h_ft", method="ghost", loss=loss)])
    cfg.validate(["ghost"])
    ids = torch.randint(3, 200, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    students = build_students(pm, cfg, batch)
    teacher = students.teacher(batch)
    # The teacher's: the dense inputs of block 3 and of the final norm.
    with pm.use("dense") as m:
        want = _hooked_streams(m, pm.dense_layers, [3, None], ids)
    assert len(teacher.streams) == 2
    for got, w in zip(teacher.streams, want):
        torch.testing.assert_close(got, w)
    # The student's: after its operators (the first gap's applied to the dense stream entering it).
    out = students.student("ghost_h_ft", batch, teacher)
    with pm.use("ghost_h_ft") as m:
        want = _hooked_streams(m, m.model.layers, [1, None], ids)  # block 3 is the view's second block
    for got, w in zip(out.streams, want):
        torch.testing.assert_close(got, w)
    with pm.use("dense") as m:
        (x_pre,) = _hooked_streams(m, pm.dense_layers, [1], ids)
    op = pm.operators["ghost_h_ft"]["1-2"]
    first = torch.zeros(ids.shape, dtype=torch.bool)
    first[:, 0] = True
    torch.testing.assert_close(out.streams[0], op(x_pre, first), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.streams[0], x_pre)
    # The step's loss is the logit term plus hidden_weight × the hidden term.
    losses = distill_step(students, batch)
    targets, valid = next_token_targets(ids, batch["attention_mask"])
    with torch.no_grad():
        logit = chunked_distillation_loss(
            out.hidden[:, :-1], teacher.hidden[:, :-1], output_head(pm.model), valid, targets, loss
        )
        hidden = hidden_state_loss(out.streams, teacher.streams, hidden_positions(batch["attention_mask"], False))
    assert float(hidden) > 0
    torch.testing.assert_close(losses["ghost_h_ft"].detach(), logit + 1.0 * hidden)
