"""A student's trainable state is keyed by parameter name, and the zero-shot score key of a fine-tuned view
covers every trainable tensor (LoRA and block copies included), not only its operators."""

from __future__ import annotations

import pytest
import torch
from conftest import fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.distill.config import DistillConfig
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.evaluate import view_digests
from ghostdistill.pipeline.train import build_students


def _students(train: list[str]):
    pm, _ = fit_all(tiny_model("llama", 6), PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="ghost")])
    return pm, build_students(pm, DistillConfig(methods=["ghost"], train=train))


@pytest.mark.parametrize("train", [["operators"], ["lora"], ["blocks"], ["operators", "lora"]])
def test_trainable_state_is_keyed_by_name_and_a_mismatch_is_refused(train):
    pm, students = _students(train)
    state = students.trainable_state("ghost_ft")
    assert state and all(isinstance(k, str) and not k.isdigit() for k in state)
    assert set(state) == set(students.named["ghost_ft"])
    changed = {k: v + 1.0 for k, v in state.items()}
    students.load_trainable_state("ghost_ft", changed)
    for name, p in students.named["ghost_ft"].items():
        assert torch.equal(p.detach(), changed[name])
    # The same number of tensors under other names (a state saved with other settings) is refused.
    renamed = {f"x{i}.{k}": v for i, (k, v) in enumerate(state.items())}
    with pytest.raises(ValueError, match="ghost_ft: the saved state does not hold this student's tensors"):
        students.load_trainable_state("ghost_ft", renamed)
    first = next(iter(state))
    with pytest.raises(ValueError, match=f"{first} has shape"):
        students.load_trainable_state("ghost_ft", {**state, first: torch.zeros(3)})


@pytest.mark.parametrize("train", [["lora"], ["blocks"]])
def test_the_score_key_of_a_fine_tuned_view_follows_every_trainable_tensor(train):
    """With `train: [lora]` or `[blocks]` the operators of `ghost_ft` are unchanged copies: a key made of the
    operators and the step would be the same for two different students and reuse stale scores."""
    pm, students = _students(train)
    views = ["dense", "pruned", "ghost", "ghost_ft"]

    def keys():
        return view_digests(pm, views, {"source": "tiny"}, {"ghost": {"name": "ghost"}}, "fp", 5, students)

    before = keys()
    assert before == keys()  # the same tensors give the same key
    with torch.no_grad():
        name, p = next((n, p) for n, p in students.named["ghost_ft"].items() if "operators" not in n)
        p.add_(0.01)
    after = keys()
    assert after["ghost_ft"] != before["ghost_ft"], f"changing {name} did not change the key"
    assert {v: after[v] for v in views[:3]} == {v: before[v] for v in views[:3]}
