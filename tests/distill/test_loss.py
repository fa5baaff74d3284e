"""The chunked distillation loss equals the plain one, gradients included, for every option."""

import pytest
import torch
import torch.nn.functional as F

from ghostdistill.distill.loss import LossConfig, chunked_distillation_loss, distillation_loss, token_losses

V, C = 40, 16


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(C, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, C, generator=g))
    s_hidden = torch.randn(3, 7, C, generator=g, requires_grad=True)
    t_hidden = torch.randn(3, 7, C, generator=g)
    targets = torch.randint(0, V, (3, 7), generator=g)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[1, 4:] = False  # padding
    valid[2, 0] = False
    return head, s_hidden, t_hidden, targets, valid


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(kind="reverse"),
        LossConfig(kind="symmetric", temperature=2.0),
        LossConfig(top_k=5),
        LossConfig(kind="symmetric", top_k=5),
        LossConfig(ce_weight=0.5, temperature=0.5),
    ],
    ids=["forward", "reverse", "symmetric_t2", "top5", "symmetric_top5", "ce_mix"],
)
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_equals_plain_with_gradients(cfg, chunk):
    cfg.chunk_tokens = chunk
    head, s_hidden, t_hidden, targets, valid = _case()
    plain = distillation_loss(head(s_hidden), head(t_hidden).detach(), valid, targets, cfg)
    (g_plain_h, g_plain_w) = torch.autograd.grad(plain, [s_hidden, head.weight])
    chunked = chunked_distillation_loss(s_hidden, t_hidden, head, valid, targets, cfg)
    (g_chunk_h, g_chunk_w) = torch.autograd.grad(chunked, [s_hidden, head.weight])
    torch.testing.assert_close(chunked, plain)
    torch.testing.assert_close(g_chunk_h, g_plain_h)
    torch.testing.assert_close(g_chunk_w, g_plain_w)
    assert g_chunk_h[~valid].abs().sum() == 0  # padding gets no gradient


def test_forward_kl_by_hand_and_zero_at_the_teacher():
    z_t = torch.tensor([[2.0, 0.0, -1.0]])
    z_s = torch.tensor([[0.0, 1.0, 0.0]])
    p, q = F.softmax(z_t, -1), F.softmax(z_s, -1)
    expected = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(token_losses(z_s, z_t, None, LossConfig()), expected)
    reverse = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(token_losses(z_s, z_t, None, LossConfig(kind="reverse")), reverse)
    assert float(token_losses(z_t, z_t, None, LossConfig(kind="symmetric"))) == pytest.approx(0.0, abs=1e-7)


def test_top_k_renormalises_the_teacher():
    z_t = torch.tensor([[5.0, 4.0, -9.0, -9.0]])
    z_s = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    p = F.softmax(z_t[:, :2], -1)  # the teacher's top-2, renormalised
    log_q = F.log_softmax(z_s, -1)[:, :2]  # the student's full log-softmax at those tokens
    expected = (p * (p.log() - log_q)).sum(-1)
    torch.testing.assert_close(token_losses(z_s, z_t, None, LossConfig(top_k=2)), expected)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("kind", "jeffreys", "kind 'jeffreys'"),
        ("temperature", 0.0, "temperature"),
        ("top_k", 0, "top_k"),
        ("ce_weight", 1.5, "ce_weight"),
        ("chunk_tokens", 0, "chunk_tokens"),
    ],
)
def test_bad_loss_settings_are_named(field, value, match):
    cfg = LossConfig(**{field: value})
    with pytest.raises(ValueError, match=match):
        cfg.validate()
