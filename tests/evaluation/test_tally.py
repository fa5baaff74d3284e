"""`ViewTally`: float64 sums per (view, source), means taken after the sums, against hand values; and the
states add across processes (`dist_reduce_fx="sum"`, here through `merge_state`, the same reduction)."""

from __future__ import annotations

import math

import pytest
import torch

from ghostdistill.evaluation.metrics import TokenScores
from ghostdistill.evaluation.tally import ViewTally


def scores(nll, kl=None, top1=None):
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return TokenScores(nll=t(nll), kl=t(kl), top1=t(top1))


def test_means_are_taken_over_all_tokens_of_all_batches_by_hand():
    tally = ViewTally(["dense", "ghost"], ["wiki", "c4"])
    tally.update("dense", 0, scores([1.0, 2.0]))
    tally.update("dense", 0, scores([3.0]))
    tally.update("ghost", 0, scores([2.0, 2.0], kl=[0.5, 0.1], top1=[1.0, 0.0]))
    tally.update("ghost", 0, scores([5.0], kl=[0.3], top1=[1.0]))
    tally.update("ghost", 1, scores([0.5], kl=[0.2], top1=[0.0]))
    out = tally.compute()
    # dense on wiki: mean NLL (1 + 2 + 3) / 3 = 2, no KL or top-1 of its own
    assert out["dense"]["wiki"] == {"ppl": pytest.approx(math.exp(2.0)), "tokens": 3, "kl": None, "top1": None}
    # ghost on wiki: NLL 9 / 3 = 3, KL 0.9 / 3 = 0.3, top-1 2 / 3 — a mean of the batches' means would give others
    assert out["ghost"]["wiki"]["ppl"] == pytest.approx(math.exp(3.0))
    assert out["ghost"]["wiki"]["kl"] == pytest.approx(0.3)
    assert out["ghost"]["wiki"]["top1"] == pytest.approx(2 / 3)
    assert out["ghost"]["c4"] == {
        "ppl": pytest.approx(math.exp(0.5)),
        "tokens": 1,
        "kl": pytest.approx(0.2),
        "top1": 0.0,
    }
    assert out["dense"]["c4"]["tokens"] == 0  # nothing read: n = 0, reported as such
    assert tally.nll.dtype == torch.float64


def test_two_ranks_states_add_to_the_one_process_result():
    """What `compute` does under torch.distributed: each state summed over the ranks, then the means."""
    batches = [("dense", 0, scores([1.0, 4.0])), ("ghost", 0, scores([2.0], kl=[0.4], top1=[1.0]))]
    batches += [("dense", 0, scores([0.5])), ("ghost", 0, scores([3.0, 1.0], kl=[0.1, 0.2], top1=[0.0, 1.0]))]
    whole, rank0, rank1 = (ViewTally(["dense", "ghost"], ["wiki"]) for _ in range(3))
    for i, (view, source, s) in enumerate(batches):
        whole.update(view, source, s)
        (rank0 if i < 2 else rank1).update(view, source, s)
    rank0.merge_state(rank1)
    assert rank0.compute() == whole.compute()


def test_float64_sums_keep_what_float32_would_lose():
    """A million tokens of NLL 1e-8 on top of one of 1.0: a float32 running sum stops moving."""
    tally = ViewTally(["dense"], ["wiki"])
    tally.update("dense", 0, scores([1.0]))
    for _ in range(4):
        tally.update("dense", 0, TokenScores(nll=torch.full((250_000,), 1e-8)))
    assert float(tally.nll[0, 0]) == pytest.approx(1.0 + 1e-2, rel=1e-6)


def test_a_tally_without_views_or_sources_is_refused():
    with pytest.raises(ValueError, match="at least one view and one source"):
        ViewTally([], ["wiki"])
