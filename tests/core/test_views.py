import pytest
import torch

from conftest import TINY_FAMILIES, tiny_model
from ghostdistill.core.operator import GhostOperator
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel


def _ids(batch=2, seq=12, seed=0):
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_views_switch_and_restore(family):
    model = tiny_model(family, num_layers=6)
    ids = _ids()
    dense = model(ids).logits
    pm = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    pm.add_method("ghost", {"2-3": GhostOperator(64)})
    with pm.use("pruned") as m:
        assert len(pm.stack.layers) == 4 and m.config.num_hidden_layers == 4
        assert [layer.self_attn.layer_idx for layer in pm.stack.layers] == [0, 1, 2, 3]
        if hasattr(m.config, "layer_types"):
            assert len(m.config.layer_types) == 4
        pruned = m(ids).logits
    # A zero operator is the identity: the ghost view equals the pruned view.
    with pm.use("ghost") as m:
        torch.testing.assert_close(m(ids).logits, pruned)
    assert not torch.allclose(pruned, dense)
    torch.testing.assert_close(model(ids).logits, dense)
    assert [layer.self_attn.layer_idx for layer in pm.stack.layers] == list(range(6))
    with pytest.raises(ValueError, match="unknown view 'nope'"):
        pm.set_view("nope")


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generation_with_kv_cache_after_pruning(family):
    model = tiny_model(family, num_layers=6)
    pm = PrunedModel(model, PruningPlan.from_layers([1, 2, 4], 6))
    g = torch.Generator().manual_seed(1)
    ops = {}
    for key in ("1-2", "4-4"):
        op = GhostOperator(64, separate_first=True)
        op.load_solution(0.05 * torch.randn(64, 64, generator=g), torch.randn(64, generator=g))
        ops[key] = op
    pm.add_method("ghost", ops)
    prompt = _ids(batch=1, seq=5)
    for view in ("pruned", "ghost"):
        with pm.use(view) as m:
            cached = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
            uncached = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=0)
        assert cached.shape == (1, 11)
        # The cache must see the same positions (first-position tokens included) as a full forward.
        torch.testing.assert_close(cached, uncached)


@torch.no_grad()
def test_operator_is_applied_at_the_gap_and_to_first_tokens_separately():
    model = tiny_model("llama", num_layers=6)
    pm = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    seen = {}
    pm.dense_layers[4].register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].clone()))
    op = GhostOperator(64, separate_first=True)
    op.load_solution(torch.eye(64), torch.full((64,), 3.0))  # W = 2I for ordinary tokens, +3 for the first
    pm.add_method("ghost", {"2-3": op})
    ids = _ids(batch=1, seq=6)
    with pm.use("pruned") as m:
        m(ids)
    # The pre-hook registered after ours sees the transformed stream; compare with the pruned input.
    plain = seen["x"]
    with pm.use("ghost") as m:
        m(ids)
    torch.testing.assert_close(seen["x"][:, 1:], 2 * plain[:, 1:])
    torch.testing.assert_close(seen["x"][:, :1], plain[:, :1] + 3.0)


@torch.no_grad()
def test_gap_at_the_end_acts_before_the_final_norm():
    model = tiny_model("llama", num_layers=6)
    pm = PrunedModel(model, PruningPlan.from_layers([4, 5], 6, allow_edges=True))
    op = GhostOperator(64)
    op.load_solution(-torch.eye(64))  # W = 0: the final norm sees zeros
    pm.add_method("zero", {"4-5": op})
    ids = _ids()
    with pm.use("zero") as m:
        hidden = m.model(ids).last_hidden_state
    assert torch.count_nonzero(hidden) == 0


def test_bf16_model_with_float32_operator():
    model = tiny_model("llama", num_layers=6).to(torch.bfloat16)
    pm = PrunedModel(model, PruningPlan.from_layers([3], 6))
    op = GhostOperator(64, separate_first=True)
    op.load_solution(0.01 * torch.randn(64, 64), torch.randn(64))
    pm.add_method("ghost", {"3-3": op})
    assert op.delta.dtype == torch.float32
    with torch.no_grad(), pm.use("ghost") as m:
        out = m.generate(_ids(batch=1, seq=4), max_new_tokens=3, do_sample=False, pad_token_id=0)
        logits = m(_ids()).logits
    assert out.shape == (1, 7) and logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_methods_must_cover_every_gap():
    pm = PrunedModel(tiny_model("llama", num_layers=6), PruningPlan.from_layers([1, 3], 6))
    with pytest.raises(ValueError, match="3-3"):
        pm.add_method("ghost", {"1-1": GhostOperator(64)})
    with pytest.raises(ValueError, match="reserved"):
        pm.add_method("dense", {"1-1": GhostOperator(64), "3-3": GhostOperator(64)})
