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
