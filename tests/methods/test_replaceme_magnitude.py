"""ReplaceMe and magnitude: the fits, and folding them into weights equals the hooked views."""

import copy

import pytest
import torch
from conftest import fit_all, random_batches, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import GapTaps, RecoveryConfig, fit_gap
from ghostdistill.methods.magnitude import fold_residual_scale
from ghostdistill.methods.replaceme import ReplaceMeStatistics, fuse_mlp_map

C = 64


def test_replaceme_recovers_an_exact_map_and_fuses_into_down_proj():
    torch.manual_seed(0)
    t_true = torch.eye(C, dtype=torch.float64) + 0.2 * torch.randn(C, C, dtype=torch.float64)
    m = torch.randn(1, 500, C, dtype=torch.float64)
    y = torch.randn(1, 500, C, dtype=torch.float64)
    stats = ReplaceMeStatistics(C)
    stats.update(GapTaps(y + m, y + m @ t_true, torch.ones(1, 500), torch.zeros(1, 500, dtype=torch.bool), m))
    fit = fit_gap(RecoveryConfig(method="replaceme", ridge=1e-12), PruningPlan.from_layers([2], 6).gaps[0], stats, C)
    assert fit.operator is None and fit.mlp_map.fused
    torch.testing.assert_close(
        fit.mlp_map.delta.detach().double() + torch.eye(C, dtype=torch.float64), t_true, atol=1e-5, rtol=1e-5
    )


@torch.no_grad()
def test_fused_weights_equal_the_hooked_views():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    pm, _ = fit_all(
        model, plan, [RecoveryConfig(name="rm", method="replaceme"), RecoveryConfig(name="mag", method="magnitude")]
    )
    ids = random_batches(1, seed=3)[0]["input_ids"]
    with pm.use("rm") as m:
        hooked_rm = m(ids).logits
    with pm.use("mag") as m:
        hooked_mag = m(ids).logits
    t = pm.mlp_maps["rm"]["2-3"].delta.double() + torch.eye(C, dtype=torch.float64)
    s = float(pm.operators["mag"]["2-3"].delta[0, 0]) + 1.0
    assert s != pytest.approx(1.0)
    for fold, expected in (("rm", hooked_rm), ("mag", hooked_mag)):
        clone = copy.deepcopy(model)
        layers = [clone.model.layers[i] for i in plan.kept]
        if fold == "rm":
            fuse_mlp_map(clone.model.layers[1], t)
        else:
            fold_residual_scale([clone.model.layers[i] for i in (4, 5)], s)
        clone.model.layers = torch.nn.ModuleList(layers)
        clone.config.num_hidden_layers = len(layers)
        for j, layer in enumerate(layers):
            layer.self_attn.layer_idx = j
        # RMSNorm's eps makes the magnitude fold exact only up to eps/‖x‖².
        torch.testing.assert_close(clone(ids).logits, expected, atol=2e-3, rtol=2e-3)
