import pytest
import torch

from conftest import tiny_model
from ghostdistill.criterion import block_similarity, candidate_starts, choose_plan
from ghostdistill.model import decoder_stack
from ghostdistill.plan import PlanConfig


def _identity_blocks(model, layers):
    # A block whose attention and MLP write nothing passes the residual stream through unchanged.
    stack = decoder_stack(model)
    with torch.no_grad():
        for i in layers:
            stack.layers[i].self_attn.o_proj.weight.zero_()
            stack.layers[i].mlp.down_proj.weight.zero_()
    return model


def _batches():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 512, (2, 16), generator=g)} for _ in range(2)]


@pytest.mark.parametrize("criterion", ["streamline", "angular", "angular_last"])
def test_criteria_find_the_blocks_that_do_nothing(criterion):
    model = _identity_blocks(tiny_model("llama", num_layers=8), [4, 5])
    plan = choose_plan(PlanConfig(criterion=criterion, num_layers=2), model, decoder_stack(model), _batches())
    assert plan.removed == (4, 5)
    assert plan.chosen_by == criterion
    assert plan.scores["4-5"] == pytest.approx(1.0 if criterion == "streamline" else 0.0, abs=1e-3)


def test_edges_are_protected_unless_allowed():
    assert candidate_starts(8, 2, allow_edges=False) == [1, 2, 3, 4, 5]
    assert candidate_starts(8, 2, allow_edges=True) == list(range(7))
    model = _identity_blocks(tiny_model("llama", num_layers=8), [0, 1])
    plan = choose_plan(PlanConfig(num_layers=2), model, decoder_stack(model), _batches())
    assert 0 not in plan.removed and 7 not in plan.removed
    plan = choose_plan(PlanConfig(num_layers=2, allow_edges=True), model, decoder_stack(model), _batches())
    assert plan.removed == (0, 1)
    with pytest.raises(ValueError, match="cannot remove 7"):
        candidate_starts(8, 7, allow_edges=False)


def test_padding_is_masked_per_token():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    garbage = ids.clone()
    garbage[1, 6:] = torch.randint(0, 512, (4,), generator=g)
    a = block_similarity(model, stack, [{"input_ids": ids, "attention_mask": mask}], 2)
    b = block_similarity(model, stack, [{"input_ids": garbage, "attention_mask": mask}], 2)
    for i in a:
        assert a[i]["cosine"] == pytest.approx(b[i]["cosine"], abs=1e-6)
    # Without the mask the padded tokens count, and the score changes.
    c = block_similarity(model, stack, [{"input_ids": garbage}], 2)
    assert any(abs(a[i]["cosine"] - c[i]["cosine"]) > 1e-4 for i in a)


def test_criterion_needs_num_layers():
    model = tiny_model("llama", num_layers=6)
    with pytest.raises(ValueError, match="num_layers"):
        choose_plan(PlanConfig(criterion="streamline"), model, decoder_stack(model), _batches())
