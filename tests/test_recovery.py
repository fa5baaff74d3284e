import copy

import pytest
import torch

from conftest import tiny_model
from ghostdistill.calibration import accumulate, accumulate_students
from ghostdistill.fold import fold_residual_scale, fuse_mlp_map
from ghostdistill.hadamard import hadamard_matrix
from ghostdistill.plan import PruningPlan
from ghostdistill.pruning import PrunedModel
from ghostdistill.recovery import RecoveryConfig, fit_gap, identity_fit, validate_recovery
from ghostdistill.statistics import GapTaps, LinearPatchStatistics, ReplaceMeStatistics, make_collectors

C = 64


def _batches(n=8, batch=4, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 512, (batch, seq), generator=g)} for _ in range(n)]


def _fit_all(model, plan, methods):
    pm = PrunedModel(model, plan)
    stats = {g.key: make_collectors({c.method for c in methods}, C, "cpu") for g in plan.gaps}
    accumulate(model, pm.stack, plan.gaps, _batches(), stats)
    for cfg in methods:
        fits = {g.key: fit_gap(cfg, g, stats[g.key].get(cfg.method), C) for g in plan.gaps}
        pm.add_method(cfg.name, {k: f.operator for k, f in fits.items() if f.operator is not None},
                      {k: f.mlp_map for k, f in fits.items() if f.mlp_map is not None})
    return pm, stats


def test_linearpatch_is_symmetric_and_matches_a_rotated_scaling():
    torch.manual_seed(0)
    h = hadamard_matrix(C)
    assert torch.allclose(h @ h.T, torch.eye(C, dtype=h.dtype), atol=1e-12)
    scale = torch.rand(C, dtype=torch.float64) + 0.5
    x = torch.randn(2, 300, C, dtype=torch.float64)
    y = ((x @ h) * scale) @ h.T  # the post-gap stream is a scaling in the rotated basis
    stats = LinearPatchStatistics(C)
    stats.update(GapTaps(x, y, torch.ones(2, 300), torch.zeros(2, 300, dtype=torch.bool)))
    gap = PruningPlan.from_layers([2], 6).gaps[0]
    rot = fit_gap(RecoveryConfig(method="linearpatch"), gap, stats, C).operator
    w = rot.delta.detach().double() + torch.eye(C, dtype=torch.float64)
    torch.testing.assert_close(w, w.T)
    torch.testing.assert_close(w, (h * scale) @ h.T, atol=1e-5, rtol=1e-5)
    diag = fit_gap(RecoveryConfig(method="linearpatch", variant="diag"), gap, stats, C).operator
    wd = diag.delta.detach() + torch.eye(C)
    assert torch.count_nonzero(wd - torch.diag(torch.diagonal(wd))) == 0


def test_linearpatch_rotate_needs_a_hadamard_size():
    stats = LinearPatchStatistics(6)  # 6 has no Hadamard matrix
    with pytest.raises(ValueError, match="6"):
        fit_gap(RecoveryConfig(method="linearpatch"), PruningPlan.from_layers([2], 6).gaps[0], stats, 6)


def test_replaceme_recovers_an_exact_map_and_fuses_into_down_proj():
    torch.manual_seed(0)
    t_true = torch.eye(C, dtype=torch.float64) + 0.2 * torch.randn(C, C, dtype=torch.float64)
    m = torch.randn(1, 500, C, dtype=torch.float64)
    y = torch.randn(1, 500, C, dtype=torch.float64)
    stats = ReplaceMeStatistics(C)
    stats.update(GapTaps(y + m, y + m @ t_true, torch.ones(1, 500), torch.zeros(1, 500, dtype=torch.bool), m))
    fit = fit_gap(RecoveryConfig(method="replaceme", ridge=1e-12), PruningPlan.from_layers([2], 6).gaps[0], stats, C)
    assert fit.operator is None and fit.mlp_map.fused
    torch.testing.assert_close(fit.mlp_map.delta.detach().double() + torch.eye(C, dtype=torch.float64), t_true,
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_fused_weights_equal_the_hooked_views():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    pm, _ = _fit_all(model, plan, [RecoveryConfig(name="rm", method="replaceme"),
                                   RecoveryConfig(name="mag", method="magnitude")])
    ids = _batches(1, seed=3)[0]["input_ids"]
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


@torch.no_grad()
def test_every_method_gives_a_view_and_none_equals_pruned():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    methods = [RecoveryConfig(name="none", method="none"), RecoveryConfig(name="ghost"),
               RecoveryConfig(name="lp", method="linearpatch"), RecoveryConfig(name="lpd", method="linearpatch", variant="diag"),
               RecoveryConfig(name="rm", method="replaceme"), RecoveryConfig(name="mag", method="magnitude")]
    pm, _ = _fit_all(model, plan, methods)
    ids = _batches(1, seed=4)[0]["input_ids"]
    with pm.use("pruned") as m:
        pruned = m(ids).logits
    outs = {}
    for cfg in methods:
        with pm.use(cfg.name) as m:
            outs[cfg.name] = m(ids).logits
    torch.testing.assert_close(outs["none"], pruned)
    for name in ("ghost", "lp", "lpd", "rm", "mag"):
        assert not torch.allclose(outs[name], pruned), name


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
    batch = _batches(1)[0]
    spent = accumulate_students(pm, gap2, [batch], {"ghost": collectors})
    assert set(spent) == {"dense", "ghost"} and all(t > 0 for t in spent.values())
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


@pytest.mark.parametrize(
    "cfg, match",
    [(RecoveryConfig(name="x", method="lora"), "method 'lora'"), (RecoveryConfig(name="x", variant="full"), "variant 'full'"),
     (RecoveryConfig(name="x", order="random"), "order 'random'"), (RecoveryConfig(name="a.b"), "'a.b'"),
     (RecoveryConfig(name="x", ridge=-1.0), "ridge")],
)
def test_bad_recovery_values_are_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        validate_recovery([cfg])


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
        accumulate(model, pm.stack, [first], _batches(2), {first.key: stats})
        fit = fit_gap(cfg, first, stats[cfg.method], C)
        later = identity_fit(cfg, C)  # the second gap is what the students' statistics are for
        pm.add_method(cfg.name, {first.key: fit.operator, second.key: later.operator} if fit.operator is not None else {},
                      {first.key: fit.mlp_map} if fit.mlp_map is not None else {})

    def collectors() -> dict:
        return {"ghost": make_collectors({"ghost"}, C, "cpu"), "rm": make_collectors({"ghost", "replaceme"}, C, "cpu")}

    alone = collectors()
    for view, feeds in alone.items():
        accumulate_students(pm, second, _batches(2), {view: feeds})
    together = collectors()
    spent = accumulate_students(pm, second, _batches(2), together)
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
