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
    """With the gap at the end of the stack, the operator maps the last kept block's output and the final
    norm then normalises x·W. A W that is not a multiple of I (RMSNorm undoes a scale) tells that apart
    from W applied after the norm, and from no operator at all."""
    model = tiny_model("llama", num_layers=6)
    pm = PrunedModel(model, PruningPlan.from_layers([4, 5], 6, allow_edges=True))
    delta = 0.5 * torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    op = GhostOperator(64)
    op.load_solution(delta)  # W = I + delta
    pm.add_method("ghost", {"4-5": op})
    ids = _ids()
    norm = model.model.norm
    seen = {}
    handle = norm.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].clone()))
    with pm.use("pruned") as m:
        pruned = m.model(ids).last_hidden_state
    stream = seen["x"]  # what the final norm receives without the operator: block 3's output
    with pm.use("ghost") as m:
        hidden = m.model(ids).last_hidden_state
    handle.remove()
    torch.testing.assert_close(seen["x"], stream + stream @ delta)  # the norm now sees x·W
    before = norm(stream + stream @ delta)
    after = norm(stream) + norm(stream) @ delta
    torch.testing.assert_close(hidden, before)
    assert (before - after).abs().max() > 0.1 and (before - pruned).abs().max() > 0.1


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


def test_under_autocast_the_operator_keeps_the_residual_stream_in_its_dtype():
    """bf16-mixed training: only the product x·M runs in bfloat16; the residual add stays float32 like the
    teacher's stream (addmm under autocast would round the whole stream to bfloat16)."""
    from ghostdistill.core.modeling_ghostdistill import GapOperator

    torch.manual_seed(0)
    op = GapOperator(16)
    torch.nn.init.normal_(op.delta, std=0.1)
    x = torch.randn(2, 5, 16) * 30.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = op(x)
        product = x.reshape(-1, 16) @ op.delta
    assert y.dtype == torch.float32 and product.dtype == torch.bfloat16
    torch.testing.assert_close(y, x + product.float().view_as(x), rtol=0, atol=0)
    # The stream keeps float32's bits: rounded to bfloat16 (as addmm under autocast does) it would change.
    assert not torch.equal(y, y.bfloat16().float())
    torch.testing.assert_close(op(x), x + x @ op.delta.detach(), rtol=1e-5, atol=1e-4)
