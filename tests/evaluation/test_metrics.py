"""Chunked metrics equal the plain computation over the whole tensor, whatever the chunk."""

import pytest
import torch
import torch.nn.functional as F

from ghostdistill.evaluation.metrics import next_token_nll, next_token_targets, score_tokens


@pytest.mark.parametrize("chunk", [1, 3, 7, 1024])
def test_chunked_scores_equal_the_plain_ones(chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 50, generator=g)
    ref_logits = torch.randn(2, 9, 50, generator=g)
    targets = torch.randint(0, 50, (2, 9), generator=g)
    logp, ref = F.log_softmax(logits, -1), F.log_softmax(ref_logits, -1)

    reference = score_tokens(ref_logits, targets, chunk=chunk, keep_logprobs=True).logprobs
    scores = score_tokens(logits, targets, reference=reference, chunk=chunk)
    torch.testing.assert_close(scores.nll, F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
    torch.testing.assert_close(scores.kl, F.kl_div(logp, ref, log_target=True, reduction="none").sum(-1))
    torch.testing.assert_close(scores.top1, (logits.argmax(-1) == ref_logits.argmax(-1)).float())


def test_next_token_nll_masks_padding_and_keeps_gradients():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 20, generator=g, requires_grad=True)
    ids = torch.randint(0, 20, (2, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    total, count = next_token_nll(logits, ids, mask, chunk_tokens=2)
    targets, valid = next_token_targets(ids, mask)
    assert count == 5 + 2 == int(valid.sum())
    plain = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")[valid].sum()
    torch.testing.assert_close(total, plain)
    (grad,) = torch.autograd.grad(total, logits)
    (plain_grad,) = torch.autograd.grad(plain, logits)
    torch.testing.assert_close(grad, plain_grad)
    assert grad[1, 3:].abs().sum() == 0  # padded positions get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_scores_from_hidden_states_equal_the_full_logits_path(chunk, dtype):
    """The chunked path (final hidden states, head per chunk, dense and view together) gives the metrics of
    the old path (each model's full logits, the dense log-probabilities kept whole), padding included."""
    from conftest import tiny_model

    from ghostdistill.core.head import final_hidden, output_head
    from ghostdistill.core.plan import PruningPlan
    from ghostdistill.core.views import PrunedModel
    from ghostdistill.evaluation.metrics import score_hidden

    model = tiny_model("llama").to(dtype)
    pm = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    targets, valid = next_token_targets(ids, mask)
    with torch.no_grad():
        old, hidden = {}, {}
        for view in ("dense", "pruned"):
            with pm.use(view) as m:
                old[view] = m(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
                hidden[view] = final_hidden(m, ids, mask)[:, :-1]
        reference = score_tokens(old["dense"], targets, keep_logprobs=True)
        before = score_tokens(old["pruned"], targets, reference=reference.logprobs)
        after = score_hidden(hidden, output_head(model), targets, valid, reference="dense", chunk=chunk)
    assert after["dense"].kl is None and after["pruned"].nll.shape == (int(valid.sum()),)
    torch.testing.assert_close(after["dense"].nll, reference.nll[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after["pruned"].nll, before.nll[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after["pruned"].kl, before.kl[valid], rtol=1e-5, atol=1e-5)
    assert torch.equal(after["pruned"].top1, before.top1[valid])
    assert after["pruned"].kl.min() >= -1e-6 and after["pruned"].kl.mean() > 1e-3  # a real difference


def test_output_head_applies_the_family_soft_cap():
    """Gemma 2's forward caps logits after the head; the chunked path must do the same."""
    from types import SimpleNamespace

    from ghostdistill.core.head import output_head

    lin = torch.nn.Linear(4, 6, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: lin, config=SimpleNamespace(final_logit_softcapping=2.0))
    h = torch.randn(3, 4) * 10
    torch.testing.assert_close(output_head(model)(h), 2.0 * torch.tanh(lin(h) / 2.0))
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens, got 0"):
        from ghostdistill.core.head import token_chunks

        list(token_chunks(5, 0))
