import pytest
import torch

from conftest import tiny_model
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.capture import residual_streams
from ghostdistill.methods import GapTaps
from ghostdistill.methods.ghost import GhostStatistics
from ghostdistill.core.model import decoder_stack
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.methods import RecoveryConfig
from ghostdistill.methods.ghost import fit_ghost


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
            taps = GapTaps(x, x + torch.randn(4, 64, 16), torch.ones(4, 64), torch.zeros(4, 64, dtype=torch.bool),
                           torch.randn(4, 64, 16))
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
