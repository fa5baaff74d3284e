"""The chat score's definitions (`data.run_chat`) against values computed by hand: KL and top-1 on answer
tokens only, the shared prefix per answer, and the tally's means."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import DENSE, PRUNED, PrunedModel
from ghostdistill.data import ChatWindows
from ghostdistill.evaluation.metrics import TokenScores, leading_agreement
from ghostdistill.evaluation.tally import ViewTally
from ghostdistill.pipeline.evaluate import evaluate, score_views


def test_leading_agreement_by_hand():
    valid = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    # row 0: agree, agree, disagree -> 2; row 1: disagree first -> 0; row 2: no answer (left out); row 3: 2 of 2
    agree = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert leading_agreement(agree, valid).tolist() == [2.0, 0.0, 2.0]


def test_the_tally_averages_the_prefix_per_answer_and_only_on_chat_sources():
    tally = ViewTally(["dense", "ghost"], ["wiki", "chat"])
    t = torch.tensor
    tally.update("ghost", 0, TokenScores(nll=t([1.0]), kl=t([0.1]), top1=t([1.0])))
    tally.update(
        "ghost",
        1,
        TokenScores(nll=t([1.0, 1.0, 1.0]), kl=t([0.2, 0.2, 0.2]), top1=t([1.0, 0.0, 1.0]), prefix=t([1.0, 4.0])),
    )
    tally.update("ghost", 1, TokenScores(nll=t([1.0]), kl=t([0.2]), top1=t([1.0]), prefix=t([1.0])))
    tally.update("dense", 1, TokenScores(nll=t([1.0])))
    out = tally.compute()
    assert out["ghost"]["chat"]["prefix"] == pytest.approx(2.0)  # (1 + 4 + 1) / 3 answers
    assert "prefix" not in out["ghost"]["wiki"] and "prefix" not in out["dense"]["chat"]


@torch.no_grad()
def test_kl_top1_and_prefix_on_answer_tokens_equal_a_hand_computation():
    model = tiny_model("llama", num_layers=6)
    pruned = PrunedModel(model, PruningPlan.from_layers([2, 3], 6))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # a shorter sequence, right-padded
    answers = torch.zeros_like(ids)
    answers[0, 5:12] = 1
    answers[1, 3:8] = 1
    answers[2, 6:9] = 1
    # The answers are the dense model's own argmax continuation, as the score's windows are by construction.
    dense_logits = model(input_ids=ids, attention_mask=mask).logits
    ids = torch.where(answers.bool(), torch.cat([ids[:, :1], dense_logits.argmax(-1)[:, :-1]], 1), ids)
    for _ in range(12):  # make every answer token the argmax given the (updated) prefix
        dense_logits = model(input_ids=ids, attention_mask=mask).logits
        ids = torch.where(answers.bool(), torch.cat([ids[:, :1], dense_logits.argmax(-1)[:, :-1]], 1), ids)
    scores = score_views(pruned, ids, mask, [DENSE, PRUNED], answers=answers)
    with pruned.use(PRUNED) as view:
        view_logits = view(input_ids=ids, attention_mask=mask).logits
    q = F.log_softmax(dense_logits[:, :-1].float(), -1)
    p = F.log_softmax(view_logits[:, :-1].float(), -1)
    scored = answers[:, 1:].bool() & mask[:, 1:].bool() & mask[:, :-1].bool()
    kl = (q.exp() * (q - p)).sum(-1)[scored]
    agree = (q.argmax(-1) == p.argmax(-1))[scored].float()
    torch.testing.assert_close(scores[PRUNED].kl, kl, atol=1e-5, rtol=1e-4)
    assert torch.equal(scores[PRUNED].top1, agree)
    prefix = []
    for row in range(3):
        hits = (p.argmax(-1)[row] == ids[row, 1:])[scored[row]].tolist()
        prefix.append(float(next((i for i, h in enumerate(hits) if not h), len(hits))))
    assert scores[PRUNED].prefix.tolist() == prefix
    assert scores[DENSE].prefix is None
    # The whole-source evaluation gives the means of the same numbers.
    result = evaluate(pruned, [DENSE, PRUNED], {"chat": ChatWindows(ids, mask, answers)}, batch_size=2)
    metrics = result[PRUNED].metrics["chat"]
    assert metrics.tokens == int(scored.sum())
    assert metrics.kl == pytest.approx(float(kl.double().mean()), rel=1e-4)
    assert metrics.top1 == pytest.approx(float(agree.mean()))
    assert metrics.prefix == pytest.approx(sum(prefix) / 3)
    again = evaluate(pruned, [DENSE, PRUNED], {"chat": ChatWindows(ids, mask, answers)}, batch_size=3)
    assert again[PRUNED].metrics["chat"].prefix == metrics.prefix  # other batches, the same answers scored
    assert again[PRUNED].metrics["chat"].kl == pytest.approx(metrics.kl, rel=1e-5)
