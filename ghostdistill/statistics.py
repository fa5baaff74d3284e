"""Per-gap calibration statistics, one collector per recovery method, all fed by one calibration pass.

Each collector keeps only fixed-size float64 sums (C×C or C), never activations, and can be saved and
restored so that an interrupted calibration resumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hadamard import hadamard_matrix, has_hadamard


@dataclass
class GapTaps:
    """What one batch shows of one gap. `mlp_out` is the MLP output of the last block before the gap
    (only captured when a collector needs it, for ReplaceMe)."""

    x_pre: torch.Tensor
    x_post: torch.Tensor
    mask: torch.Tensor
    first: torch.Tensor
    mlp_out: torch.Tensor | None = None


@dataclass
class TokenCounts:
    regular: int = 0
    first: int = 0
    massive_first: int = 0
    massive_other: int = 0


class GhostStatistics:
    """Float64 accumulators for one gap, split by token group so every fit variant comes from one pass.

    `plain_*` are unweighted, `weighted_*` weigh each token's residual by 1/max(‖x_pre‖, ‖x_post‖);
    `rest` excludes first-position tokens, `first` holds only them.
    """

    GROUPS = ("plain_rest", "plain_first", "weighted_rest", "weighted_first")
    # A token whose x_post norm exceeds this multiple of the median is counted as a massive activation
    # (reported only: it tells the user whether sinks other than the first token exist).
    MASSIVE_RATIO = 20.0

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        c = hidden_size
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        self.xtx = {g: z(c, c) for g in self.GROUPS}
        self.xtd = {g: z(c, c) for g in self.GROUPS}
        self.first_delta_sum = z(c)
        self.counts = TokenCounts()

    @torch.no_grad()
    def update(self, taps: "GapTaps") -> None:
        x_pre, x_post, first = taps.x_pre, taps.x_post, taps.first
        keep = taps.mask.bool()
        x = x_pre[keep].to(torch.float64)
        d = x_post[keep].to(torch.float64) - x
        is_first = first[keep]
        post_norm = (x + d).norm(dim=-1)
        weight = 1.0 / torch.maximum(x.norm(dim=-1), post_norm).clamp_min(1e-12)
        for group, rows in (("rest", ~is_first), ("first", is_first)):
            if not rows.any():
                continue
            xs, ds, ws = x[rows], d[rows], weight[rows].unsqueeze(1)
            self.xtx[f"plain_{group}"] += xs.T @ xs
            self.xtd[f"plain_{group}"] += xs.T @ ds
            xw, dw = xs * ws, ds * ws
            self.xtx[f"weighted_{group}"] += xw.T @ xw
            self.xtd[f"weighted_{group}"] += xw.T @ dw
        self.first_delta_sum += d[is_first].sum(0)
        massive = post_norm > self.MASSIVE_RATIO * post_norm.median()
        self.counts.regular += int((~is_first).sum())
        self.counts.first += int(is_first.sum())
        self.counts.massive_first += int((massive & is_first).sum())
        self.counts.massive_other += int((massive & ~is_first).sum())

    def normal_equations(self, weighted: bool, include_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "weighted" if weighted else "plain"
        xtx, xtd = self.xtx[f"{kind}_rest"].clone(), self.xtd[f"{kind}_rest"].clone()
        if include_first:
            xtx += self.xtx[f"{kind}_first"]
            xtd += self.xtd[f"{kind}_first"]
        return xtx, xtd

    def first_shift(self) -> torch.Tensor:
        return self.first_delta_sum / max(self.counts.first, 1)

    def state_dict(self) -> dict:
        return {
            "xtx": self.xtx,
            "xtd": self.xtd,
            "first_delta_sum": self.first_delta_sum,
            "counts": vars(self.counts).copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.xtx = {k: v.to(torch.float64) for k, v in state["xtx"].items()}
        self.xtd = {k: v.to(torch.float64) for k, v in state["xtd"].items()}
        self.first_delta_sum = state["first_delta_sum"].to(torch.float64)
        self.counts = TokenCounts(**state["counts"])


class LinearPatchStatistics:
    """Per-channel mean magnitudes of X_pre and X_post, in the Hadamard-rotated basis and in the plain one.

    LinearPatch (Chen et al. 2025) sets W = H·diag(s)·Hᵀ with s_j = mean|X_post H|_j / mean|X_pre H|_j;
    the rotation spreads the few outlier channels over all channels before the per-channel scaling.
    """

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        z = lambda: torch.zeros(hidden_size, dtype=torch.float64, device=device)  # noqa: E731
        self.hidden_size = hidden_size
        self.rotated = has_hadamard(hidden_size)
        self._h = hadamard_matrix(hidden_size).to(device) if self.rotated else None
        self.sums = {"pre": z(), "post": z(), "pre_rot": z(), "post_rot": z()}
        self.tokens = 0

    def hadamard(self) -> torch.Tensor:
        if self._h is None:
            # The error names the size and what is valid.
            hadamard_matrix(self.hidden_size)
        return self._h

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        keep = taps.mask.bool()
        x = taps.x_pre[keep].to(torch.float64)
        y = taps.x_post[keep].to(torch.float64)
        self.sums["pre"] += x.abs().sum(0)
        self.sums["post"] += y.abs().sum(0)
        if self._h is not None:
            self.sums["pre_rot"] += (x @ self._h).abs().sum(0)
            self.sums["post_rot"] += (y @ self._h).abs().sum(0)
        self.tokens += x.shape[0]

    def state_dict(self) -> dict:
        return {"sums": self.sums, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: v.to(torch.float64) for k, v in state["sums"].items()}
        self.tokens = state["tokens"]


class MagnitudeStatistics:
    """Mean token norms of X_pre and X_post: Prune&Comp's single magnitude-compensation scalar."""

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        self.norm_pre = torch.zeros((), dtype=torch.float64, device=device)
        self.norm_post = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = 0

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        keep = taps.mask.bool()
        self.norm_pre += taps.x_pre[keep].to(torch.float64).norm(dim=-1).sum()
        self.norm_post += taps.x_post[keep].to(torch.float64).norm(dim=-1).sum()
        self.tokens += int(keep.sum())

    def state_dict(self) -> dict:
        return {"norm_pre": self.norm_pre, "norm_post": self.norm_post, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.norm_pre, self.norm_post = state["norm_pre"].double(), state["norm_post"].double()
        self.tokens = state["tokens"]


class ReplaceMeStatistics:
    """Normal equations of ReplaceMe (Shopkhoev et al. 2025): with M the MLP output of the last block
    before the gap and Y = X_pre − M its residual input, min_T ‖M T − (X_post − Y)‖²; T is then fused
    into that block's down_proj."""

    needs_mlp = True

    def __init__(self, hidden_size: int, device: torch.device | str = "cpu") -> None:
        c = hidden_size
        self.mtm = torch.zeros(c, c, dtype=torch.float64, device=device)
        self.mtr = torch.zeros(c, c, dtype=torch.float64, device=device)
        self.tokens = 0

    @torch.no_grad()
    def update(self, taps: GapTaps) -> None:
        if taps.mlp_out is None:
            raise RuntimeError("ReplaceMe statistics need the MLP output of the block before the gap")
        keep = taps.mask.bool()
        m = taps.mlp_out[keep].to(torch.float64)
        y = taps.x_pre[keep].to(torch.float64) - m
        target = taps.x_post[keep].to(torch.float64) - y
        self.mtm += m.T @ m
        self.mtr += m.T @ target
        self.tokens += m.shape[0]

    def state_dict(self) -> dict:
        return {"mtm": self.mtm, "mtr": self.mtr, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.mtm, self.mtr, self.tokens = state["mtm"].double(), state["mtr"].double(), state["tokens"]


# Which collector each recovery method reads.
COLLECTORS = {
    "ghost": GhostStatistics,
    "linearpatch": LinearPatchStatistics,
    "magnitude": MagnitudeStatistics,
    "replaceme": ReplaceMeStatistics,
}


def make_collectors(methods: set[str], hidden_size: int, device: torch.device | str) -> dict[str, object]:
    return {m: COLLECTORS[m](hidden_size, device=device) for m in sorted(methods) if m in COLLECTORS}
