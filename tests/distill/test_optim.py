"""The optimizer of fine-tuned recovery: the warm-up + cosine schedule by hand values, on its own and as
the learning rate an AdamW step actually uses, and gradient clipping per student."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ghostdistill.distill.config import DistillConfig
from ghostdistill.distill.optim import clip_per_student, make_optimizer, warmup_cosine
from ghostdistill.distill.students import StudentParams

# warmup 4, total 10, min_ratio 0.05, by hand: (step + 1) / 4 during the warm-up (the first step at
# lr/4, step 3 at the full lr), then r + (1 − r)·½(1 + cos(π·(step − 4)/6)).
HAND = {
    0: 0.25,
    1: 0.5,
    2: 0.75,
    3: 1.0,
    4: 1.0,  # progress 0
    7: 0.05 + 0.95 * 0.5,  # progress ½: cos = 0
    9: 0.05 + 0.95 * 0.5 * (1 - math.sqrt(3) / 2),  # progress 5/6
    10: 0.05,  # progress 1: lr · min_ratio
    12: 0.05,  # past the end: stays there
}


@pytest.mark.parametrize("step", sorted(HAND))
def test_warmup_cosine_by_hand(step):
    assert warmup_cosine(step, 10, 4, 0.05) == pytest.approx(HAND[step], abs=1e-12)


def test_without_warmup_the_first_step_has_the_full_rate():
    assert warmup_cosine(0, 10, 0, 0.05) == 1.0
    assert warmup_cosine(5, 10, 0, 0.05) == pytest.approx(0.05 + 0.95 * 0.5)
    assert warmup_cosine(3, 2, 4, 0.05) == 1.0  # total within the warm-up: no decay after it
    assert warmup_cosine(7, 2, 4, 0.05) == 1.0


def _students(*names: str, size: int = 3) -> dict[str, StudentParams]:
    return {
        n: StudentParams(
            operators=[nn.Parameter(torch.zeros(size, size))], lora=[], blocks=[nn.Parameter(torch.zeros(size))]
        )
        for n in names
    }


def test_the_optimizer_steps_with_the_scheduled_rate():
    """The lr each AdamW step uses, read from the optimizer: step k runs with lr · HAND[k] (LambdaLR sets the
    step-0 value when it is built, Lightning calls scheduler.step() after each optimizer step)."""
    cfg = DistillConfig(lr=1e-2, block_lr=1e-3, warmup_steps=4, min_lr_ratio=0.05)
    params = _students("a_ft")
    optimizer, scheduler = make_optimizer(params, cfg, total_steps=10)
    assert [g["name"] for g in optimizer.param_groups] == ["a_ft/operators", "a_ft/blocks"]
    seen = []
    for _ in range(11):
        seen.append([g["lr"] for g in optimizer.param_groups])
        for p in params["a_ft"].all():
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    for step, expected in HAND.items():
        if step < len(seen):
            assert seen[step] == pytest.approx([1e-2 * expected, 1e-3 * expected], rel=1e-12), step
    assert seen[0][0] > 0, "the first optimizer step must not run at lr 0"


def test_each_student_is_clipped_on_its_own():
    """Two students with huge gradients and one with tiny ones: each huge one ends at norm `value`, the tiny
    one is untouched (one global norm over all three would have shrunk it)."""
    params = _students("big_ft", "huge_ft", "tiny_ft")
    scales = {"big_ft": 100.0, "huge_ft": 1e4, "tiny_ft": 1e-3}
    g = torch.Generator().manual_seed(0)
    for name, p in params.items():
        for t in p.all():
            t.grad = torch.randn(t.shape, generator=g) * scales[name]
    tiny_before = [t.grad.clone() for t in params["tiny_ft"].all()]
    optimizer, _ = make_optimizer(params, DistillConfig(), total_steps=10)
    assert len(optimizer.param_groups) == 6  # two kinds per student: clipping must gather them by student

    def norm(name):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.grad) for t in params[name].all()]))

    assert norm("tiny_ft") < 1.0 < norm("big_ft")
    clip_per_student(optimizer, 1.0, "norm")
    for name in ("big_ft", "huge_ft"):
        assert norm(name) == pytest.approx(1.0, rel=1e-4)
    assert all(torch.equal(t.grad, b) for t, b in zip(params["tiny_ft"].all(), tiny_before, strict=True))

    # By value: every element within [-value, value], the tiny student's unchanged; None and 0 do nothing.
    for name, p in params.items():
        for t in p.all():
            t.grad = torch.randn(t.shape, generator=g) * scales[name]
    tiny_before = [t.grad.clone() for t in params["tiny_ft"].all()]
    huge_before = [t.grad.clone() for t in params["huge_ft"].all()]
    clip_per_student(optimizer, None, "norm")
    clip_per_student(optimizer, 0.0, None)
    assert all(torch.equal(t.grad, b) for t, b in zip(params["huge_ft"].all(), huge_before, strict=True))
    clip_per_student(optimizer, 0.5, "value")
    assert all(t.grad.abs().max() <= 0.5 for n in ("big_ft", "huge_ft") for t in params[n].all())
    assert all(torch.equal(t.grad, b) for t, b in zip(params["tiny_ft"].all(), tiny_before, strict=True))


def test_clipping_matches_what_the_module_does():
    """`clip_per_student` with algorithm None is the norm clip (Lightning's default)."""
    params = _students("a_ft", "b_ft")
    for p in params.values():
        for t in p.all():
            t.grad = torch.full_like(t, 10.0)
    optimizer, _ = make_optimizer(params, DistillConfig(), total_steps=1)
    clip_per_student(optimizer, 2.0, None)
    for p in params.values():
        total = torch.linalg.vector_norm(torch.cat([t.grad.flatten() for t in p.all()]))
        assert total == pytest.approx(2.0, rel=1e-4)
