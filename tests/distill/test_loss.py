"""The chunked distillation loss equals the plain one, gradients included, for every option."""

import math

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


def _cached(logits: torch.Tensor, k: int, tau: float):
    from ghostdistill.distill.teacher_cache import topk_entry

    return topk_entry(logits, k, tau)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(kind="reverse"),
        LossConfig(kind="symmetric", temperature=2.0),
        LossConfig(ce_weight=0.5, temperature=0.5),
    ],
    ids=["forward", "reverse", "symmetric_t2", "ce_mix"],
)
def test_cached_topk_loss_equals_the_full_loss_where_k_covers_the_vocabulary(cfg):
    from ghostdistill.distill.loss import cached_token_losses

    g = torch.Generator().manual_seed(3)
    s_logits = torch.randn(9, V, generator=g, requires_grad=True)
    t_logits = torch.randn(9, V, generator=g) * 3
    targets = torch.randint(0, V, (9,), generator=g)
    full = token_losses(s_logits, t_logits, targets, cfg)
    (g_full,) = torch.autograd.grad(full.sum(), s_logits)
    cached = cached_token_losses(s_logits, _cached(t_logits, V, cfg.temperature), targets, cfg)
    (g_cached,) = torch.autograd.grad(cached.sum(), s_logits)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cached, g_full, rtol=1e-5, atol=1e-6)


def test_cached_topk_loss_by_hand_with_its_tail_mass():
    """k = 1 of 3 tokens: the teacher (0.7 | 0.2, 0.1), the student (0.5 | 0.3, 0.2) on {top token, rest}:
    forward KL = 0.7 ln(0.7/0.5) + 0.3 ln(0.3/0.5); reverse = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3)."""
    from ghostdistill.distill.loss import cached_token_losses

    t = torch.tensor([[0.7, 0.2, 0.1]]).log()
    s = torch.tensor([[0.5, 0.3, 0.2]]).log()
    entry = _cached(t, 1, 1.0)
    assert entry[1].tolist() == [[0]]
    forward = cached_token_losses(s, entry, None, LossConfig())
    reverse = cached_token_losses(s, entry, None, LossConfig(kind="reverse"))
    assert forward.item() == pytest.approx(0.7 * math.log(0.7 / 0.5) + 0.3 * math.log(0.3 / 0.5), rel=1e-5)
    assert reverse.item() == pytest.approx(0.5 * math.log(0.5 / 0.7) + 0.5 * math.log(0.5 / 0.3), rel=1e-5)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_cached_topk_loss_is_a_lower_bound_that_tightens_with_k(k):
    """Lumping the tail into one outcome never raises the KL (data processing), and more tokens kept lose less."""
    from ghostdistill.distill.loss import cached_token_losses

    g = torch.Generator().manual_seed(k)
    s_logits, t_logits = torch.randn(50, V, generator=g), torch.randn(50, V, generator=g) * 2
    full = token_losses(s_logits, t_logits, None, LossConfig())
    lumped = cached_token_losses(s_logits, _cached(t_logits, k, 1.0), None, LossConfig())
    wider = cached_token_losses(s_logits, _cached(t_logits, 2 * k, 1.0), None, LossConfig())
    assert (lumped <= full + 1e-6).all() and (wider >= lumped - 1e-6).all()
    assert wider.sum() > lumped.sum()


def test_cached_topk_with_loss_top_k_renormalises_as_the_live_loss():
    from ghostdistill.distill.loss import cached_token_losses

    g = torch.Generator().manual_seed(5)
    s_logits, t_logits = torch.randn(6, V, generator=g), torch.randn(6, V, generator=g)
    for cfg in (LossConfig(top_k=5), LossConfig(kind="symmetric", top_k=5, temperature=2.0)):
        live = token_losses(s_logits, t_logits, None, cfg)
        cached = cached_token_losses(s_logits, _cached(t_logits, 16, cfg.temperature), None, cfg)
        torch.testing.assert_close(cached, live, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_chunked_cached_loss_equals_the_per_token_sum(chunk):
    from ghostdistill.distill.loss import cached_token_losses, chunked_cached_loss

    head, s_hidden, t_hidden, targets, valid = _case(1)
    cfg = LossConfig(chunk_tokens=chunk)
    with torch.no_grad():
        t_logits = head(t_hidden)
    entry = [x.view(3, 7, *x.shape[1:]) for x in _cached(t_logits.view(21, V), 8, 1.0)]
    got = chunked_cached_loss(s_hidden, head, valid, targets, entry, cfg)
    (g_got,) = torch.autograd.grad(got, s_hidden)
    ref = cached_token_losses(head(s_hidden[valid]), [x[valid] for x in entry], None, cfg).mean()
    (g_ref,) = torch.autograd.grad(ref, s_hidden)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(kind="reverse"),
        LossConfig(kind="symmetric", temperature=2.0),
        LossConfig(ce_weight=0.5, temperature=0.5),
        LossConfig(ce_weight=0.3, kind="reverse"),
    ],
    ids=["forward", "reverse", "symmetric_t2", "ce_mix_t05", "ce_reverse"],
)
@pytest.mark.parametrize("k", [6, V], ids=["k6", "k_vocab"])
@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_fused_cached_loss_equals_the_autograd_reference_with_gradients(cfg, k, chunk):
    """The hand-written gradient (`distill/cached_loss.py`) against autograd through `chunked_cached_loss`, for
    the hidden states and a trained head (a `tail` student's) with a bias."""
    from ghostdistill.distill.cached_loss import fused_cached_loss
    from ghostdistill.distill.loss import chunked_cached_loss

    head, s_hidden, t_hidden, targets, valid = _case(2)
    head.bias = torch.nn.Parameter(torch.randn(V) * 0.1)
    cfg.chunk_tokens = chunk
    with torch.no_grad():
        entry = [x.view(3, 7, *x.shape[1:]) for x in _cached(head(t_hidden).view(21, V) * 2, k, cfg.temperature)]
    ref = chunked_cached_loss(s_hidden, head, valid, targets, entry, cfg)
    ref_grads = torch.autograd.grad(ref, [s_hidden, head.weight, head.bias])
    got = fused_cached_loss(s_hidden, head, valid, targets, entry, cfg)
    got_grads = torch.autograd.grad(got, [s_hidden, head.weight, head.bias])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_fused_cached_loss_under_bfloat16_autocast_is_close_to_float32():
    from ghostdistill.distill.cached_loss import fused_cached_loss

    head, s_hidden, t_hidden, targets, valid = _case(4)
    with torch.no_grad():
        entry = [x.view(3, 7, *x.shape[1:]) for x in _cached(head(t_hidden).view(21, V), 8, 1.0)]
    full = fused_cached_loss(s_hidden, head, valid, targets, entry, LossConfig())
    (g_full,) = torch.autograd.grad(full, s_hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = fused_cached_loss(s_hidden, head, valid, targets, entry, LossConfig())
    (g_half,) = torch.autograd.grad(half, s_hidden)
    assert half.dtype == torch.float32 and g_half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.02)
    assert (g_half - g_full).norm() < 0.05 * g_full.norm()
