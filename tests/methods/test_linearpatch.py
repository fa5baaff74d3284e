"""LinearPatch: the fitted W = H·diag(s)·Hᵀ."""

import pytest
import torch

from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import GapTaps, RecoveryConfig, fit_gap
from ghostdistill.methods.hadamard import hadamard_matrix
from ghostdistill.methods.linearpatch import LinearPatchStatistics

C = 64


def test_linearpatch_matches_a_rotated_scaling():
    torch.manual_seed(0)
    h = hadamard_matrix(C)
    scale = torch.rand(C, dtype=torch.float64) + 0.5
    x = torch.randn(2, 300, C, dtype=torch.float64)
    y = ((x @ h) * scale) @ h.T  # the post-gap stream is a scaling in the rotated basis
    stats = LinearPatchStatistics(C)
    stats.update(GapTaps(x, y, torch.ones(2, 300), torch.zeros(2, 300, dtype=torch.bool)))
    gap = PruningPlan.from_layers([2], 6).gaps[0]
    rot = fit_gap(RecoveryConfig(method="linearpatch"), gap, stats, C).operator
    w = rot.delta.detach().double() + torch.eye(C, dtype=torch.float64)
    # Mean |.| per rotated channel scales exactly by s_j, so the fit finds H·diag(s)·Hᵀ.
    torch.testing.assert_close(w, (h * scale) @ h.T, atol=1e-5, rtol=1e-5)


def test_linearpatch_scales_are_the_per_channel_ratio_on_a_hand_made_input():
    """diag variant: s_j = mean|X_post|_j / mean|X_pre|_j over the non-padding tokens, worked by hand."""
    c = 4
    x = torch.tensor([[[1.0, -2.0, 4.0, 0.5], [3.0, 2.0, -4.0, 1.5], [100.0, 100.0, 100.0, 100.0]]])
    y = torch.tensor([[[2.0, 1.0, -4.0, 0.0], [-2.0, 3.0, 12.0, 3.0], [-7.0, 7.0, 7.0, 7.0]]])
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding
    stats = LinearPatchStatistics(c)
    stats.update(GapTaps(x, y, mask, torch.zeros(1, 3, dtype=torch.bool)))
    gap = PruningPlan.from_layers([2], 6).gaps[0]
    w = fit_gap(
        RecoveryConfig(method="linearpatch", variant="diag"), gap, stats, c
    ).operator.delta.detach() + torch.eye(c)
    # (|2|+|-2|)/(|1|+|3|) = 1, (1+3)/(2+2) = 1, (4+12)/(4+4) = 2, (0+3)/(0.5+1.5) = 1.5
    torch.testing.assert_close(w, torch.diag(torch.tensor([1.0, 1.0, 2.0, 1.5])))


def test_linearpatch_rotate_needs_a_hadamard_size():
    stats = LinearPatchStatistics(6)  # 6 has no Hadamard matrix
    # The message names the bad size, what sizes are valid, the nearest valid one and the way out.
    with pytest.raises(ValueError, match=r"no Hadamard matrix of order 6 is known") as info:
        fit_gap(RecoveryConfig(method="linearpatch"), PruningPlan.from_layers([2], 6).gaps[0], stats, 6)
    message = str(info.value)
    for part in (
        "supported orders are 1, 2, 4, ... (powers of two) and m·2^k for m in {12, 20, 28",
        "the next supported order is 8",
        "linearpatch variant 'diag'",
    ):
        assert part in message, (part, message)
