import pytest
import torch
from conftest import tiny_model

from ghostdistill.core.model import decoder_stack
from ghostdistill.planning import (
    PlanConfig,
    block_influence,
    block_similarity,
    candidate_blocks,
    candidate_starts,
    choose,
    protected_edges,
    removal_perplexity,
)


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
    plan = choose(PlanConfig(criterion=criterion, num_layers=2), model, _batches())
    assert plan.removed == (4, 5)
    assert plan.chosen_by == criterion
    assert plan.scores["4-5"] == pytest.approx(1.0 if criterion == "streamline" else 0.0, abs=1e-3)


def test_edges_are_protected_unless_allowed():
    assert candidate_starts(8, 2) == [1, 2, 3, 4, 5]
    assert candidate_starts(8, 2, keep_first=0, keep_last=0) == list(range(7))
    model = _identity_blocks(tiny_model("llama", num_layers=8), [0, 1])
    plan = choose(PlanConfig(num_layers=2), model, _batches())
    assert 0 not in plan.removed and 7 not in plan.removed
    plan = choose(PlanConfig(num_layers=2, allow_edges=True), model, _batches())
    assert plan.removed == (0, 1)
    with pytest.raises(ValueError, match="cannot remove 7"):
        candidate_starts(8, 7)


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
        choose(PlanConfig(criterion="streamline"), model, _batches())


# ---------------------------------------------------------------- per-block criteria (ShortGPT, Shortened LLaMA)
PER_BLOCK = ["block_influence", "ppl", "taylor"]
IDENTITY = [1, 3, 5]
_CACHE: dict[str, object] = {}


def _own_text(model, rows=8, length=16):
    """Windows sampled from the model itself: its expected NLL on them is its entropy plus the KL to any
    other model, so removing a block that changes nothing is the one removal that cannot hurt (on random
    tokens a random block's removal can lower the perplexity)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (rows, 1), generator=g)
    with torch.no_grad():
        for _ in range(length - 1):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=g)], 1)
    return [{"input_ids": ids[: rows // 2]}, {"input_ids": ids[rows // 2 :]}]


def _identity_model_and_text():
    """7 blocks, 1, 3 and 5 of them identity, and text sampled from it (sampled once per session)."""
    model = _identity_blocks(tiny_model("llama", num_layers=7), IDENTITY)
    with torch.no_grad():
        # A sharper next-token distribution makes every real block's removal cost clearly more than the
        # sampling noise of a few hundred tokens.
        model.lm_head.weight.mul_(3.0)
    if "text" not in _CACHE:
        _CACHE["text"] = _own_text(model)
    return model, _CACHE["text"]


@pytest.mark.parametrize("criterion", PER_BLOCK)
def test_per_block_criteria_find_non_contiguous_blocks_and_respect_keep(criterion):
    model, batches = _identity_model_and_text()
    plan = choose(PlanConfig(criterion=criterion, num_layers=3), model, batches)
    assert plan.removed == (1, 3, 5)
    assert [g.key for g in plan.gaps] == ["1-1", "3-3", "5-5"]
    assert plan.chosen_by == criterion
    assert sorted(plan.scores) == ["1", "2", "3", "4", "5"]  # blocks 0 and 6 are protected by default
    real = min(plan.scores["2"], plan.scores["4"])
    if criterion == "ppl":
        # Removing an identity block leaves the model exactly as it was.
        assert plan.scores["1"] == pytest.approx(plan.scores["3"], rel=1e-5)
        assert plan.scores["1"] == pytest.approx(plan.scores["5"], rel=1e-5)
        assert real > 1.2 * plan.scores["1"]
    else:
        assert max(plan.scores[k] for k in ("1", "3", "5")) == pytest.approx(0.0, abs=1e-5)
        assert real > 1e-3
    # keep_first=2 protects identity block 1, keep_last=2 identity block 5.
    plan = choose(PlanConfig(criterion=criterion, num_layers=1, keep_first=2, keep_last=2), model, batches)
    assert plan.removed == (3,)
    assert sorted(plan.scores) == ["2", "3", "4"]


def test_keep_first_and_keep_last_apply_to_contiguous_criteria():
    model, batches = _identity_model_and_text()
    plan = choose(PlanConfig(num_layers=1, keep_first=2, keep_last=2), model, batches)
    assert plan.removed == (3,)
    assert sorted(plan.scores) == ["2-2", "3-3", "4-4"]


def test_edge_options():
    assert candidate_starts(8, 2, keep_first=4, keep_last=2) == [4]
    assert candidate_starts(8, 1, keep_first=0, keep_last=3) == [0, 1, 2, 3, 4]
    assert candidate_blocks(32, 5, 4, 2) == list(range(4, 30))  # Shortened LLaMA's Taylor+
    with pytest.raises(ValueError, match="cannot remove 3 contiguous layers from 8 .*first 4 and last 2.*at most 2"):
        candidate_starts(8, 3, keep_first=4, keep_last=2)
    with pytest.raises(ValueError, match="cannot remove 7 layers from 8 .*first 1 and last 1; 6 are removable"):
        candidate_blocks(8, 7, 1, 1)
    with pytest.raises(ValueError, match="at most 7 can go"):
        candidate_blocks(8, 8, 0, 0)  # at least one block must remain
    assert protected_edges(PlanConfig(allow_edges=True)) == (0, 0)
    assert protected_edges(PlanConfig(keep_first=4, keep_last=2)) == (4, 2)
    with pytest.raises(ValueError, match="allow_edges"):
        protected_edges(PlanConfig(allow_edges=True, keep_first=4, keep_last=2))
    with pytest.raises(ValueError, match=">= 0"):
        PlanConfig(num_layers=2, keep_first=-1).validate()


@pytest.mark.parametrize("edges", [dict(keep_first=0), dict(keep_first=0, keep_last=0), dict(allow_edges=True)])
def test_unprotected_first_block_can_go(edges):
    model = _identity_blocks(tiny_model("llama", num_layers=6), [0])
    cfg = PlanConfig(criterion="block_influence", num_layers=1, **edges)
    plan = choose(cfg, model, _batches())
    assert plan.removed == (0,)


def test_clear_errors():
    model = tiny_model("llama", num_layers=6)
    with pytest.raises(ValueError, match="'nope' is not known.*streamline.*block_influence, ppl, taylor"):
        choose(PlanConfig(criterion="nope", num_layers=1), model, _batches())
    with pytest.raises(ValueError, match="cannot remove 5 layers from 6 .*4 are removable"):
        choose(PlanConfig(criterion="ppl", num_layers=5), model, _batches())
    with pytest.raises(ValueError, match="criterion_samples"):
        choose(PlanConfig(criterion="ppl", num_layers=1, criterion_samples=0), model, _batches())


def test_block_influence_and_ppl_mask_padding():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    garbage = ids.clone()
    garbage[1, 6:] = torch.randint(0, 512, (4,), generator=g)
    blocks = list(range(6))
    for score in (block_influence, removal_perplexity):
        a = score(model, stack, [{"input_ids": ids, "attention_mask": mask}], blocks)
        b = score(model, stack, [{"input_ids": garbage, "attention_mask": mask}], blocks)
        assert a == pytest.approx(b, rel=1e-5)
    # Without the mask the padded tokens count, and the score changes.
    c = removal_perplexity(model, stack, [{"input_ids": garbage}], blocks)
    assert c != pytest.approx(a, rel=1e-5)


@pytest.mark.parametrize("criterion", ["ppl", "taylor"])
def test_criterion_samples_uses_the_first_windows(criterion):
    model = tiny_model("llama", num_layers=5)
    batches = _batches()  # 2 batches of 2 windows
    first3 = [batches[0], {"input_ids": batches[1]["input_ids"][:1]}]
    capped = choose(PlanConfig(criterion=criterion, num_layers=1, criterion_samples=3), model, batches)
    direct = choose(PlanConfig(criterion=criterion, num_layers=1), model, first3)
    # Were the cap ignored, `capped` would see the fourth window as well and differ from `direct`.
    assert capped.scores == pytest.approx(direct.scores, rel=1e-6)


def test_taylor_restores_grad_state_and_mode():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    model.train()
    stack.layers[2].train(False)
    model.lm_head.weight.requires_grad_(True)
    stack.layers[3].mlp.up_proj.weight.requires_grad_(True)
    marker = torch.full_like(stack.layers[3].mlp.up_proj.weight, 7.0)
    stack.layers[3].mlp.up_proj.weight.grad = marker
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    plan = choose(PlanConfig(criterion="taylor", num_layers=1), model, _batches())
    assert set(plan.scores) == {"1", "2", "3", "4"}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    assert torch.equal(stack.layers[3].mlp.up_proj.weight.grad, torch.full_like(marker, 7.0))
    assert {n: m.training for n, m in model.named_modules()} == modes


@pytest.mark.parametrize("family", ["qwen3"])  # qwen3 also has a per-layer config list
def test_ppl_leaves_the_model_as_it_was(family):
    model = tiny_model(family, num_layers=6)
    stack = decoder_stack(model)
    layers = list(stack.layers)
    layer_types = getattr(model.config, "layer_types", None)
    ids = _batches()[0]["input_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    # allow_edges: removing the last block hosts the (inactive) operator hook on the one before it.
    plan = choose(PlanConfig(criterion="ppl", num_layers=2, allow_edges=True), model, _batches())
    assert len(plan.removed) == 2 and set(plan.scores) == {str(i) for i in range(6)}
    assert list(decoder_stack(model).layers) == layers
    assert model.config.num_hidden_layers == 6
    assert getattr(model.config, "layer_types", None) == layer_types
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(6))
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_a_new_criterion_is_one_object_and_one_register_call():
    """What adding a criterion takes: an object with the Criterion members (`PerBlock` from a score), passed
    to `register`; the config accepts its name, `check_plan` counts its candidates, `choose` runs it."""
    from ghostdistill.planning import PerBlock, check_plan, criteria, register, unregister

    def latest_first(model, stack, batches, blocks):
        return {b: -float(b) for b in blocks}  # the deepest removable blocks score lowest

    register(PerBlock("latest", latest_first))
    try:
        assert "latest" in criteria()
        cfg = PlanConfig(criterion="latest", num_layers=2)
        cfg.validate()
        assert check_plan(cfg, 6) is None
        plan = choose(cfg, tiny_model("llama", num_layers=6), _batches())
        assert plan.removed == (3, 4) and plan.chosen_by == "latest"  # keep_last = 1 protects block 5
        with pytest.raises(ValueError, match=r"criterion 'latest' is registered by .*PerBlock; .*PerBlock cannot"):
            register(PerBlock("latest", lambda *args: {}))
    finally:
        unregister("latest")
    with pytest.raises(ValueError, match="plan.criterion 'latest' is not known; choose one of streamline"):
        PlanConfig(criterion="latest", num_layers=2).validate()
