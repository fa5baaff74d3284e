import pytest
import torch
from conftest import tiny_model

from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.capture import residual_streams
from ghostdistill.core.model import decoder_stack
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.methods import GapTaps, RecoveryConfig
from ghostdistill.methods.ghost import GhostStatistics, fit_ghost


def _batches(n=4, batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 512, (batch, seq), generator=g)} for _ in range(n)]


@torch.no_grad()
def test_residual_streams_match_hidden_states_and_stop_early():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    ids = _batches(1)[0]["input_ids"]
    ref = model(ids, output_hidden_states=True).hidden_states
    reached = []
    handle = stack.layers[5].register_forward_pre_hook(lambda *a: reached.append(True))
    mlp = {}
    streams, first = residual_streams(model, stack, ids, None, [1, 3], mlp_blocks=[0], mlp_out=mlp)
    handle.remove()
    torch.testing.assert_close(streams[1], ref[1])
    torch.testing.assert_close(streams[3], ref[3])
    assert not reached, "the forward pass should stop after the last block it needs"
    assert first[:, 0].all() and not first[:, 1:].any()
    # The MLP output is what block 0 adds after its attention: X_1 = Y_0 + MLP_0.
    assert mlp[0].shape == streams[1].shape and torch.count_nonzero(mlp[0]) > 0
    # Point 6 = output of the last block, before the final norm (hidden_states[-1] is after it).
    streams, _ = residual_streams(model, stack, ids, None, [6])
    torch.testing.assert_close(model.model.norm(streams[6]), ref[6])
    with pytest.raises(ValueError, match="out of range"):
        residual_streams(model, stack, ids, None, [7])


def test_streamed_statistics_equal_the_full_batch_computation():
    torch.manual_seed(0)
    x_pre = torch.randn(3, 10, 8)
    x_post = x_pre + torch.randn(3, 10, 8)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[2, 7:] = 0  # padding never enters the statistics
    first = torch.zeros(3, 10, dtype=torch.bool)
    first[:, 0] = True
    whole = GhostStatistics(8)
    whole.update(GapTaps(x_pre, x_post, mask, first))
    streamed = GhostStatistics(8)
    for i in range(3):
        streamed.update(GapTaps(x_pre[i : i + 1], x_post[i : i + 1], mask[i : i + 1], first[i : i + 1]))
    for group in GhostStatistics.GROUPS:
        torch.testing.assert_close(streamed.xtx[group], whole.xtx[group])
    keep = mask.bool() & ~first
    x = x_pre[keep].double()
    d = x_post[keep].double() - x
    torch.testing.assert_close(whole.xtx["plain_rest"], x.T @ x)
    torch.testing.assert_close(whole.xtd["plain_rest"], x.T @ d)
    assert whole.counts.regular == 3 * 9 - 3 and whole.counts.first == 3
    torch.testing.assert_close(whole.first_shift(), (x_post[:, 0].double() - x_pre[:, 0].double()).mean(0))


@pytest.mark.parametrize("method", ["ghost", "linearpatch", "magnitude", "replaceme"])
def test_memory_of_statistics_stays_flat_when_tokens_grow(method):
    """Measured: the whole collector object, serialised, is the same size after 8x the tokens."""
    import io

    from ghostdistill.methods import make_collectors

    def serialised_size(batches: int) -> int:
        torch.manual_seed(0)
        collector = make_collectors({method}, 16, "cpu")[method]
        for _ in range(batches):
            x = torch.randn(4, 64, 16)
            taps = GapTaps(
                x,
                x + torch.randn(4, 64, 16),
                torch.ones(4, 64),
                torch.zeros(4, 64, dtype=torch.bool),
                torch.randn(4, 64, 16),
            )
            collector.update(taps)
        buf = io.BytesIO()
        torch.save(collector, buf)  # every attribute, not only what state_dict chooses to show
        return buf.tell()

    assert serialised_size(1) == serialised_size(8)


def test_fit_recovers_an_exactly_linear_gap():
    torch.manual_seed(0)
    c = 12
    w_true = torch.eye(c) + 0.3 * torch.randn(c, c)
    x_pre = torch.randn(4, 50, c)
    x_post = x_pre @ w_true
    x_post[:, 0] = x_pre[:, 0] + 100.0  # first-position tokens follow a different rule: a big shift
    first = torch.zeros(4, 50, dtype=torch.bool)
    first[:, 0] = True
    stats = GhostStatistics(c)
    stats.update(GapTaps(x_pre, x_post, torch.ones(4, 50), first))
    gap = PruningPlan.from_layers([2], 6).gaps[0]
    op = fit_ghost(RecoveryConfig(fit="first", ridge=1e-10), gap, stats)
    torch.testing.assert_close(op.delta.data + torch.eye(c), w_true, atol=1e-4, rtol=1e-4)
    out = op(x_pre, first)
    torch.testing.assert_close(out, x_post, atol=1e-3, rtol=1e-3)
    # The paper's plain fit bends W towards the outlier and misses the ordinary tokens.
    plain = fit_ghost(RecoveryConfig(fit="plain", ridge=1e-10), gap, stats)
    err_plain = (plain(x_pre)[:, 1:] - x_post[:, 1:]).norm()
    err_first = (out[:, 1:] - x_post[:, 1:]).norm()
    assert err_first < 1e-2 * err_plain


@torch.no_grad()
def test_accumulate_fits_every_gap_of_a_non_contiguous_plan():
    model = tiny_model("qwen2", num_layers=6)
    plan = PruningPlan.from_layers([1, 3, 4], 6)
    pm = PrunedModel(model, plan)
    stats = {g.key: {"ghost": GhostStatistics(64)} for g in plan.gaps}
    # Enough tokens (2048) to determine a 64×64 operator per gap.
    tokens = accumulate(model, pm.stack, plan.gaps, _batches(n=16, batch=4, seq=32), stats)
    assert tokens == 16 * 4 * 32
    assert {k: s["ghost"].counts.first for k, s in stats.items()} == {"1-1": 64, "3-4": 64}
    ops = {g.key: fit_ghost(RecoveryConfig(), g, stats[g.key]["ghost"]) for g in plan.gaps}
    pm.add_method("ghost", ops)
    ids = _batches(2, seed=5)[1]["input_ids"]
    dense = model(ids).logits.log_softmax(-1)

    def kl(view):
        with pm.use(view) as m:
            logp = m(ids).logits.log_softmax(-1)
        return float((dense.exp() * (dense - logp)).sum(-1).mean())

    assert kl("ghost") < kl("pruned")


def test_a_statistics_mask_narrows_the_sums_to_the_tokens_it_marks():
    """Chat calibration's ``chat.tokens: answers`` (`data.chat`): the forward sees every token, the statistics sum
    only the marked ones: equal to feeding the collector those tokens' taps by hand."""
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    pm = PrunedModel(model, plan)
    gap = plan.gaps[0]
    batch = _batches(1, batch=2, seq=16)[0]
    narrow = torch.zeros(2, 16, dtype=torch.long)
    narrow[0, 5:11] = 1
    narrow[1, 9:] = 1
    narrow[:, 0] = 1
    stats = {gap.key: {"ghost": GhostStatistics(64)}}
    tokens = accumulate(model, pm.stack, plan.gaps, [{**batch, "statistics_mask": narrow}], stats)
    assert tokens == int(narrow.sum())
    streams, first = residual_streams(model, pm.stack, batch["input_ids"], None, [gap.start, gap.stop])
    by_hand = GhostStatistics(64)
    by_hand.update(GapTaps(streams[gap.start], streams[gap.stop], narrow, first))
    for group in GhostStatistics.GROUPS:
        torch.testing.assert_close(stats[gap.key]["ghost"].xtx[group], by_hand.xtx[group])
    everything = {gap.key: {"ghost": GhostStatistics(64)}}
    accumulate(model, pm.stack, plan.gaps, [batch], everything)
    assert not torch.allclose(everything[gap.key]["ghost"].xtx["plain_rest"], by_hand.xtx["plain_rest"])


# ---------------------------------------------------------------- reliability
def _ppl_kl(pm, ids):
    from ghostdistill.core.head import final_hidden, output_head
    from ghostdistill.evaluation.metrics import next_token_targets, score_hidden

    mask = torch.ones_like(ids)
    targets, valid = next_token_targets(ids, mask)
    hidden = {}
    with torch.no_grad():
        for view in ("dense", "pruned", "ghost"):
            with pm.use(view) as m:
                hidden[view] = final_hidden(m, ids, mask)[:, :-1]
    scores = score_hidden(hidden, output_head(pm.model), targets, valid, reference="dense", chunk=64)
    return {
        v: (float(s.nll.double().mean().exp()), None if s.kl is None else float(s.kl.double().mean()))
        for v, s in scores.items()
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_calibrate_and_evaluate_like_float32(dtype):
    """bf16 / fp16 models: statistics and solve stay float64, operators are float32 and come out close to the
    float32 model's, and perplexity and KL agree with float32 to the half type's precision."""
    from conftest import fit_all

    plan = PruningPlan.from_layers([2, 3], 6)
    pm32, _ = fit_all(tiny_model("llama"), plan, [RecoveryConfig(name="ghost")])
    pm16, stats16 = fit_all(tiny_model("llama").to(dtype), plan, [RecoveryConfig(name="ghost")])
    ghost16 = stats16["2-3"]["ghost"]
    assert all(t.dtype == torch.float64 for t in [*ghost16.xtx.values(), *ghost16.xtd.values()])
    op32, op16 = pm32.operators["ghost"]["2-3"], pm16.operators["ghost"]["2-3"]
    assert op16.delta.dtype == torch.float32
    assert torch.isfinite(op16.delta).all()
    rel = float((op16.delta - op32.delta).detach().norm() / op32.delta.detach().norm())
    assert rel < 0.05, f"{dtype} operator differs from float32 by {rel:.3f} (relative Frobenius)"

    ids = _batches(n=1, batch=4, seq=32, seed=9)[0]["input_ids"]
    m32, m16 = _ppl_kl(pm32, ids), _ppl_kl(pm16, ids)
    for view in ("dense", "pruned", "ghost"):
        assert m16[view][0] == pytest.approx(m32[view][0], rel=0.01), view
    for view in ("pruned", "ghost"):
        assert m16[view][1] == pytest.approx(m32[view][1], rel=0.03), view
    # The repair works in half precision as it does in float32.
    assert m16["ghost"][1] < m16["pruned"][1] and m32["ghost"][1] < m32["pruned"][1]


def test_non_finite_activations_stop_calibration_naming_block_and_batch():
    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    plan = PruningPlan.from_layers([2, 3], 6)
    stats = {"2-3": {"ghost": GhostStatistics(64)}}
    batches = _batches(n=3)
    # Batch 5 (the third batch of a run that started at batch 3) overflows inside block 3.
    calls = {"n": 0}

    def overflow(module, args, output):
        calls["n"] += 1
        if calls["n"] == 3:
            hidden = output[0] if isinstance(output, tuple) else output
            hidden[0, 4, 7] = float("inf")
        return output

    handle = stack.layers[3].register_forward_hook(overflow)
    try:
        with pytest.raises(
            FloatingPointError,
            match=r"calibration batch 5: the residual stream entering block 4 "
            r"is not finite at 1 token\(s\) \(first: sequence 0, position 4",
        ):
            accumulate(model, stack, plan.gaps, batches, stats, first_batch=3)
    finally:
        handle.remove()
    assert stats["2-3"]["ghost"].counts.regular == 2 * 2 * 15, "the bad batch never reached the sums"


def test_padding_may_hold_non_finite_values():
    """Only real tokens are checked: padded positions never reach the statistics."""
    from ghostdistill.calibration.stream import check_finite

    x = torch.zeros(1, 3, 4)
    x[0, 2, 0] = float("nan")
    check_finite(x, torch.tensor([[1, 1, 0]]), "batch 0", "x", torch.nn.Linear(1, 1))
    with pytest.raises(FloatingPointError, match="batch 0: x is not finite"):
        check_finite(x, torch.tensor([[1, 1, 1]]), "batch 0", "x", torch.nn.Linear(1, 1))


def test_too_few_tokens_give_the_minimum_norm_fit_and_say_how_many_are_enough():
    from ghostdistill.core.solver import RankDeficientWarning

    model = tiny_model("llama", num_layers=6)
    stack = decoder_stack(model)
    plan = PruningPlan.from_layers([2, 3], 6)
    stats = {"2-3": {"ghost": GhostStatistics(64)}}
    accumulate(model, stack, plan.gaps, _batches(n=1, batch=2, seq=16), stats)  # 30 regular tokens < 64
    ghost = stats["2-3"]["ghost"]
    with pytest.warns(
        RankDeficientWarning,
        match=r"ghost \(ghost, fit first\) gap 2-3: 30 calibration tokens for "
        r"hidden size 64.*At least 64 tokens",
    ):
        op = fit_ghost(RecoveryConfig(name="ghost", fit="first"), plan.gaps[0], ghost)
    assert torch.isfinite(op.delta).all()
    # The minimum-norm solution of the same normal equations.
    xtx, xtd = ghost.normal_equations("plain", include_first=False)
    torch.testing.assert_close(op.delta.double(), torch.linalg.pinv(xtx) @ xtd, rtol=1e-3, atol=1e-5)
