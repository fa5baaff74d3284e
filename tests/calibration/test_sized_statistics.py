"""Collectors sized to the run's recovery entries (`make_collectors(..., recovery)`): they hold only what
the fits read, and every shipped entry solves to exactly the operators of the all-variants collector."""

import pytest
import torch
import yaml
from conftest import random_batches, tiny_model
from shipped_configs import SHIPPED as SHIPPED_CONFIGS

import ghostdistill.calibration.fit as fit_module
from ghostdistill.calibration.fit import fit_methods
from ghostdistill.calibration.state import load_state, save_state
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.methods import RecoveryConfig, fit_gap, make_collectors, statistics_layout, validate_recovery
from ghostdistill.methods.ghost import GhostStatistics, fit_groups

C = 64


def _shipped() -> dict[str, list[RecoveryConfig]]:
    """Each shipped config's recovery entries (a config that only extends another has none of its own)."""
    out = {}
    for path in SHIPPED_CONFIGS:
        entries = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("recovery")
        if entries:
            cfgs = [RecoveryConfig(**e) for e in entries]
            validate_recovery(cfgs)
            out[path.stem] = cfgs
    return out


SHIPPED = _shipped()


def _distinct_entries() -> list[RecoveryConfig]:
    seen, out = set(), []
    for cfgs in SHIPPED.values():
        for cfg in cfgs:
            key = tuple(sorted((k, str(v)) for k, v in cfg.settings().items() if k != "name"))
            if key not in seen and cfg.method != "none":  # `none` collects and fits nothing
                seen.add(key)
                out.append(cfg)
    return out


def _tensors(pm: PrunedModel, name: str) -> dict[str, torch.Tensor]:
    return {
        **{f"op.{k}": v for k, v in pm.operators[name].state_dict().items()},
        **{f"mlp.{k}": v for k, v in pm.mlp_maps[name].state_dict().items()},
    }


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str, empty: bool = False) -> None:
    """`empty`: the method fits nothing (`none`), so there is nothing to compare but the absence."""
    assert a.keys() == b.keys(), where
    assert bool(a) != empty, where
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{where}: {k} differs"


def _state_nbytes(state) -> int:
    if isinstance(state, dict):
        return sum(_state_nbytes(v) for v in state.values())
    return state.element_size() * state.numel() if isinstance(state, torch.Tensor) else 0


def test_every_shipped_config_is_read():
    assert {"smollm2_demo", "smollm2_variants", "smollm2_methods"} <= set(SHIPPED)


@torch.no_grad()
@pytest.mark.parametrize("config", sorted(SHIPPED))
def test_shipped_config_fits_bit_identically_from_its_sized_collectors(config, monkeypatch):
    """The run's layout (every entry of the config), sequential student statistics included: `fit_methods`
    with collectors sized to the entries against the same with every collector holding everything."""
    cfgs = SHIPPED[config]
    methods = {c.method for c in cfgs}
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([1, 3, 4], 6)  # two gaps: the second is fitted sequentially where asked
    batches = random_batches(3)
    tensors = {}
    for sized in (False, True):
        pm = PrunedModel(model, plan)
        stats = {g.key: make_collectors(methods, C, "cpu", cfgs if sized else None) for g in plan.gaps}
        accumulate(model, pm.stack, plan.gaps, batches, stats)
        if not sized:  # the student collectors of sequential fits hold everything too, as before
            monkeypatch.setattr(fit_module, "make_collectors", lambda m, h, d, r=None: make_collectors(m, h, d))
        fit_methods(cfgs, pm, stats, batches, C, "cpu")
        monkeypatch.undo()
        tensors[sized] = {c.name: _tensors(pm, c.name) for c in cfgs}
        pm.remove_hooks()
    for cfg in cfgs:
        _assert_identical(
            tensors[False][cfg.name], tensors[True][cfg.name], f"{config} {cfg.name}", cfg.method == "none"
        )


@torch.no_grad()
def test_every_distinct_shipped_entry_fits_bit_identically_alone():
    """Each distinct entry with a collector sized to it alone, against the all-variants collector."""
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    (gap,) = plan.gaps
    batches = random_batches(3)
    entries = _distinct_entries()
    methods = {c.method for c in entries}
    pm = PrunedModel(model, plan)
    full = {gap.key: make_collectors(methods, C, "cpu")}
    accumulate(model, pm.stack, plan.gaps, batches, full)
    for cfg in entries:
        sized = {gap.key: make_collectors({cfg.method}, C, "cpu", [cfg])}
        accumulate(model, pm.stack, plan.gaps, batches, sized)
        a = fit_gap(cfg, gap, full[gap.key][cfg.method], C)
        b = fit_gap(cfg, gap, sized[gap.key][cfg.method], C)
        for part in ("operator", "mlp_map"):
            x, y = getattr(a, part), getattr(b, part)
            assert (x is None) == (y is None)
            if x is not None:
                _assert_identical(x.state_dict(), y.state_dict(), f"{cfg.name} {part}")
    pm.remove_hooks()


def test_groups_are_what_the_fits_read():
    assert fit_groups([RecoveryConfig()]) == ("weighted_rest",)
    assert fit_groups([RecoveryConfig(fit="plain", bias=True, scale="norm")]) == ("plain_rest", "plain_first")
    assert fit_groups([RecoveryConfig(fit="first"), RecoveryConfig(fit="first_normed")]) == (
        "plain_rest",
        "normed_rest",
    )
    variants = SHIPPED["smollm2_variants"]
    assert statistics_layout({"ghost"}, [RecoveryConfig()]) == {"ghost": ["weighted_rest"]}
    # Entries of a method that can't be sized, no entries of the method, or no recovery: everything.
    assert statistics_layout({"ghost", "replaceme", "magnitude"}, [RecoveryConfig(name="r", method="replaceme")]) == {}
    assert statistics_layout({"ghost"}, None) == {}
    layout = statistics_layout({c.method for c in variants}, variants)
    # smollm2_variants asks for every ghost variant but the whole-sequence fits: one pass holds them all.
    assert layout == {"ghost": ["plain_rest", "weighted_rest", "normed_rest"], "ghost_symmetric": ["weighted_rest"]}
    every = [RecoveryConfig(name=f, fit=f) for f in ("first", "plain", "weighted", "first_weighted", "first_normed")]
    assert statistics_layout({"ghost"}, every) == {}  # every variant: the all-variants collector


def test_sized_collector_holds_only_its_groups_and_refuses_other_layouts():
    torch.manual_seed(0)
    from ghostdistill.methods import GapTaps

    x = torch.randn(2, 16, 8)
    first = torch.zeros(2, 16, dtype=torch.bool)
    first[:, 0] = True
    taps = GapTaps(x, x * 1.1 + 0.2, torch.ones(2, 16), first)
    full, small = GhostStatistics(8), make_collectors({"ghost"}, 8, "cpu", [RecoveryConfig()])["ghost"]
    full.update(taps)
    small.update(taps)
    assert small.groups == ("weighted_rest",) and set(small.state_dict()["xtx"]) == {"weighted_rest"}
    for k in ("xtx", "xtd", "xsum", "dsum", "scalars"):
        assert torch.equal(getattr(small, k)["weighted_rest"], getattr(full, k)["weighted_rest"])
    assert torch.equal(small.first_delta_sum, full.first_delta_sum) and small.counts == full.counts
    assert _state_nbytes(small.state_dict()) < _state_nbytes(full.state_dict()) / 5
    with pytest.raises(ValueError, match="sized for other recovery entries"):
        small.normal_equations("plain", include_first=True)
    with pytest.raises(ValueError, match="cannot be resumed"):
        GhostStatistics(8).load_state_dict(small.state_dict())
    with pytest.raises(ValueError, match="cannot be resumed"):
        GhostStatistics(8, groups=["weighted_rest"]).load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="choose from"):
        GhostStatistics(8, groups=["weighted_all"])


def test_saved_state_resumes_only_into_its_own_layout(tmp_path):
    plan = PruningPlan.from_layers([2, 3], 6)
    (gap,) = plan.gaps
    default = [RecoveryConfig()]
    path = tmp_path / "calibration_state.pt"
    # A state of the layout without `recovery` (everything) resumes as before.
    save_state(path, "k", plan, {gap.key: make_collectors({"ghost"}, 8, "cpu")}, 1, 2, 10)
    assert load_state(path, "k", {"ghost"}, 8).batches_done == 1
    # ... and is refused (with the existing warning) by collectors sized to the default entry.
    with pytest.warns(UserWarning, match="does not hold usable statistics"):
        assert load_state(path, "k", {"ghost"}, 8, recovery=default) is None
    # A sized state resumes into the same layout only.
    save_state(path, "k", plan, {gap.key: make_collectors({"ghost"}, 8, "cpu", default)}, 1, 2, 10)
    assert load_state(path, "k", {"ghost"}, 8, recovery=default).batches_done == 1
    with pytest.warns(UserWarning, match="does not hold usable statistics"):
        assert load_state(path, "k", {"ghost"}, 8) is None


def test_fingerprint_names_a_sized_layout_only():
    from ghostdistill.calibration.state import fingerprint
    from ghostdistill.core.model import ModelConfig
    from ghostdistill.planning import PlanConfig

    model = tiny_model("llama", num_layers=4)
    plan = PlanConfig().digest_dict()

    def key(methods, recovery=None):
        return fingerprint(ModelConfig(), model, plan, {}, 4, methods, recovery)

    every = [RecoveryConfig(name=f, fit=f) for f in ("first", "plain", "weighted", "first_weighted", "first_normed")]
    assert key({"ghost"}, every) == key({"ghost"})  # everything: the key of the layout without `recovery`
    assert key({"ghost"}, [RecoveryConfig()]) != key({"ghost"})
    assert key({"ghost"}, [RecoveryConfig()]) != key({"ghost"}, [RecoveryConfig(fit="plain")])
    assert key({"ghost"}, [RecoveryConfig()]) == key({"ghost"}, [RecoveryConfig(bias=True, ridge=0.1)])


@torch.no_grad()
def test_sized_prefixes_hold_the_sized_layout_and_the_same_sums():
    from ghostdistill.calibration.prefixes import accumulate_prefixes
    from ghostdistill.core.model import decoder_stack

    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    windows = torch.randint(0, 512, (6, 16), generator=torch.Generator().manual_seed(5))
    recovery, methods = [RecoveryConfig(name="g", fit="plain")], {"ghost", "replaceme"}
    args = (model, decoder_stack(model), plan.gaps, windows, [2, 6], methods, C, "cpu")
    full = dict(accumulate_prefixes(*args, batch_size=2))
    sized = dict(accumulate_prefixes(*args, batch_size=2, recovery=recovery))
    for n in (2, 6):
        for key, collectors in sized[n].items():
            ghost, whole = collectors["ghost"], full[n][key]["ghost"]
            assert ghost.groups == ("plain_rest", "plain_first")
            for g in ghost.groups:
                assert torch.equal(ghost.xtx[g], whole.xtx[g]) and torch.equal(ghost.xtd[g], whole.xtd[g])
            assert torch.equal(collectors["replaceme"].mtm, full[n][key]["replaceme"].mtm)
