"""Every registered method behind one interface."""

import pytest
import torch
from conftest import fit_all, random_batches, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import RecoveryConfig, validate_recovery

C = 64


@torch.no_grad()
def test_every_method_gives_a_view_and_none_equals_pruned():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    methods = [
        RecoveryConfig(name="none", method="none"),
        RecoveryConfig(name="ghost"),
        RecoveryConfig(name="lp", method="linearpatch"),
        RecoveryConfig(name="lpd", method="linearpatch", variant="diag"),
        RecoveryConfig(name="rm", method="replaceme"),
        RecoveryConfig(name="mag", method="magnitude"),
    ]
    pm, _ = fit_all(model, plan, methods)
    ids = random_batches(1, seed=4)[0]["input_ids"]
    with pm.use("pruned") as m:
        pruned = m(ids).logits
    outs = {}
    for cfg in methods:
        with pm.use(cfg.name) as m:
            outs[cfg.name] = m(ids).logits
    torch.testing.assert_close(outs["none"], pruned)
    for name in ("ghost", "lp", "lpd", "rm", "mag"):
        assert not torch.allclose(outs[name], pruned), name


@pytest.mark.parametrize(
    "cfg, match",
    [
        (RecoveryConfig(name="x", method="lora"), "method 'lora'"),
        (RecoveryConfig(name="x", method="linearpatch", variant="full"), "variant 'full'"),
        (RecoveryConfig(name="x", order="random"), "order 'random'"),
        (RecoveryConfig(name="a.b"), "'a.b'"),
        (RecoveryConfig(name="x", ridge=-1.0), "ridge"),
    ],
)
def test_bad_recovery_values_are_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        validate_recovery([cfg])
