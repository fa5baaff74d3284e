"""The evaluation's sums as a torchmetrics `Metric`: per (view, source), the NLL, the token count, the KL to
the dense teacher and the top-1 matches, each summed over tokens in float64; for a chat source also the chat
score's shared prefixes and the number of answers they were measured on.

Perplexity, KL and top-1 are means over tokens, and a mean over all ranks' tokens is a sum of sums divided by a
sum of counts. So the states are plain float64 sums with ``dist_reduce_fx="sum"``: torchmetrics adds them across
processes when `compute` runs under `torch.distributed` (DDP, FSDP2), and in one process `compute` reads them as
they are. The means are taken only after the sums are complete, so the result is exactly that of one process
reading every window once: no mean of means, and no loss of precision from float32 sums over a million tokens.

    tally = ViewTally(views, sources)         states [views, sources], float64, zero
    tally.update(view, source, scores)        one batch's `TokenScores` of one view on one source
    tally.compute()                           {view: {source: {ppl, tokens, kl, top1, prefix}}}, summed over ranks
"""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric

from .metrics import TokenScores

STATES = ("nll", "tokens", "kl", "top1", "prefix", "answers")


class ViewTally(Metric):
    """Float64 sums of NLL, tokens, KL(dense ‖ view) and top-1 agreement per (view, source); `compute`
    gives the means. `reference`: the view the others are compared with (no KL or top-1 of its own)."""

    full_state_update = False  # an update needs no earlier state: sums only
    higher_is_better = None

    def __init__(self, views: list[str], sources: list[str], reference: str = "dense") -> None:
        super().__init__()
        if not views or not sources:
            raise ValueError(f"a tally needs at least one view and one source; got views {views}, sources {sources}")
        self.views, self.sources, self.reference = list(views), list(sources), reference
        for name in STATES:
            self.add_state(name, torch.zeros(len(views), len(sources), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, view: str, source: int, scores: TokenScores) -> None:
        """Add one batch of `view` on source number `source` (its index in `sources`)."""
        at = (self.views.index(view), source)
        self.nll[at] += scores.nll.double().sum()
        self.tokens[at] += scores.nll.numel()
        if scores.kl is not None:
            self.kl[at] += scores.kl.double().sum()
            self.top1[at] += scores.top1.double().sum()
        if scores.prefix is not None:
            self.prefix[at] += scores.prefix.double().sum()
            self.answers[at] += scores.prefix.numel()

    def compute(self) -> dict[str, dict[str, dict[str, float | int | None]]]:
        """Per view and source: perplexity exp(ΣNLL / n), n, and (views but the reference) mean KL and top-1, and
        on a chat source the mean shared prefix per answer (`prefix`, only there)."""
        out: dict[str, dict[str, dict[str, float | int | None]]] = {view: {} for view in self.views}
        for vi, view in enumerate(self.views):
            for si, source in enumerate(self.sources):
                nll, tokens, kl, top1, prefix, answers = (float(getattr(self, s)[vi, si]) for s in STATES)
                n = max(tokens, 1.0)
                compared = view != self.reference
                out[view][source] = {
                    "ppl": math.exp(nll / n),
                    "tokens": int(tokens),
                    "kl": kl / n if compared else None,
                    "top1": top1 / n if compared else None,
                }
                if compared and answers:
                    out[view][source]["prefix"] = prefix / answers
        return out
