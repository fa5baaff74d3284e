"""Sequential fits: student statistics after earlier gaps are repaired, one dense pass for every method."""

import torch
from conftest import random_batches, tiny_model

from ghostdistill.calibration.stream import accumulate, accumulate_students
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.methods import RecoveryConfig, fit_gap, identity_fit, make_collectors

C = 64


@torch.no_grad()
def test_sequential_statistics_see_the_repaired_student():
    model = tiny_model("llama", num_layers=8)
    plan = PruningPlan.from_layers([2, 5], 8)
    pm = PrunedModel(model, plan)
    cfg = RecoveryConfig(name="ghost")
    gap2 = plan.gaps[1]
    # With identity operators the student's X_pre at gap 2 is the pruned model's stream entering block 6.
    pm.add_method("ghost", {g.key: identity_fit(cfg, C).operator for g in plan.gaps})
    seen = {}
    collectors = make_collectors({"ghost"}, C, "cpu")
    batch = random_batches(1)[0]
    spent = accumulate_students(pm, gap2, [batch], {"ghost": collectors})
    assert set(spent) == {"dense", "ghost"}
    handle = pm.dense_layers[6].register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    with pm.use("pruned") as m:
        m(batch["input_ids"])
    handle.remove()
    x = seen["x"][:, 1:].reshape(-1, C).double()
    torch.testing.assert_close(collectors["ghost"].xtx["plain_rest"], x.T @ x)
    # ... which differs from the dense stream the independent fit uses.
    dense = {g.key: make_collectors({"ghost"}, C, "cpu") for g in plan.gaps}
    accumulate(model, pm.stack, plan.gaps, [batch], dense)
    assert not torch.allclose(dense["5-5"]["ghost"].xtx["plain_rest"], collectors["ghost"].xtx["plain_rest"])


def _flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


@torch.no_grad()
def test_one_dense_pass_serves_every_student():
    """Several views fed in one pass collect exactly what each would collect alone."""
    model = tiny_model("llama", num_layers=8)
    plan = PruningPlan.from_layers([2, 5], 8)
    pm = PrunedModel(model, plan)
    first, second = plan.gaps
    for cfg in (RecoveryConfig(name="ghost"), RecoveryConfig(name="rm", method="replaceme")):
        stats = make_collectors({cfg.method}, C, "cpu")
        accumulate(model, pm.stack, [first], random_batches(2), {first.key: stats})
        fit = fit_gap(cfg, first, stats[cfg.method], C)
        later = identity_fit(cfg, C)  # the second gap is what the students' statistics are for
        pm.add_method(
            cfg.name,
            {first.key: fit.operator, second.key: later.operator} if fit.operator is not None else {},
            {first.key: fit.mlp_map} if fit.mlp_map is not None else {},
        )

    def collectors() -> dict:
        return {"ghost": make_collectors({"ghost"}, C, "cpu"), "rm": make_collectors({"ghost", "replaceme"}, C, "cpu")}

    alone = collectors()
    for view, feeds in alone.items():
        accumulate_students(pm, second, random_batches(2), {view: feeds})
    together = collectors()
    spent = accumulate_students(pm, second, random_batches(2), together)
    assert set(spent) == {"dense", "ghost", "rm"}
    for view, feeds in alone.items():
        for name, collector in feeds.items():
            a, b = _flat(collector.state_dict()), _flat(together[view][name].state_dict())
            assert a.keys() == b.keys() and a
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    # The two students differ (other operators at the first gap), so each view got its own stream.
    xtx = {v: together[v]["ghost"].state_dict()["xtx"]["plain_rest"] for v in together}
    assert not torch.allclose(xtx["ghost"], xtx["rm"])
