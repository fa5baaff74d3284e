"""Held-out alignment error: on the calibration tokens themselves it is the fit's own objective."""

import pytest
import torch
from conftest import fit_all, random_batches, tiny_model

from ghostdistill.analysis import analyse, held_out_alignment
from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import RecoveryConfig
from ghostdistill.methods.ghost import objective


@torch.no_grad()
def test_alignment_on_calibration_tokens_equals_the_fit_objective():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([2, 3], 6)
    methods = [
        RecoveryConfig(name="g", fit="first"),
        RecoveryConfig(name="gp", fit="plain"),
    ]
    pm, stats = fit_all(model, plan, methods)
    errors = held_out_alignment(pm, ["dense", "pruned", "g", "gp"], random_batches())  # fit_all's batches
    gap = plan.gaps[0].key
    st = stats[gap]["ghost"]
    for view, include_first in (("g", False), ("gp", True)):
        op = pm.operators[view][gap]
        err, base = objective(st, op.delta.detach().double(), None, "plain", include_first)
        e = errors[gap][view]
        if include_first:  # the plain fit maps every token by W: its objective covers both groups
            got_err, got_base = (
                e.err["other"] + e.err["first"],
                e.base["other"] + e.base["first"],
            )
        else:
            got_err, got_base = e.err["other"], e.base["other"]
        # The model runs in float32, the objective is float64 algebra on the same tokens' sums.
        assert got_base == pytest.approx(base, rel=1e-5)
        assert got_err == pytest.approx(err, rel=2e-3)
        assert e.ratio("other") < 1.0
    assert set(errors[gap]) == {"g", "gp"}  # dense and pruned have nothing at the gap
    # The separate first-position map leaves Σ‖d − mean d‖² on the first tokens: not more than doing nothing.
    assert errors[gap]["g"].ratio("first") <= 1.0
    assert errors[gap]["g"].tokens == {"other": 8 * 4 * 31, "first": 8 * 4}


@torch.no_grad()
def test_analyse_reports_every_method_and_symmetric_constructions_have_no_antisymmetric_part():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([1, 2, 4], 6)  # two gaps
    methods = [
        RecoveryConfig(name="ghost"),
        RecoveryConfig(name="sym", method="ghost_symmetric"),
        RecoveryConfig(name="lp", method="linearpatch"),
        RecoveryConfig(name="rm", method="replaceme"),
        RecoveryConfig(name="mag", method="magnitude"),
    ]
    pm, _ = fit_all(model, plan, methods)
    out = analyse(pm, ["pruned", *[m.name for m in methods]], random_batches(2, seed=9))
    assert out["held_out_windows"] == 8
    assert set(out["gaps"]) == {g.key for g in plan.gaps}
    for rows in out["gaps"].values():
        assert set(rows) == {"ghost", "sym", "lp", "rm", "mag"}
        assert rows["ghost"]["anatomy"]["antisym_share_M"] > 0.01
        assert rows["sym"]["anatomy"]["antisym_share_M"] == pytest.approx(0.0, abs=1e-12)
        assert rows["lp"]["anatomy"]["antisym_share_M"] == pytest.approx(0.0, abs=1e-10)
        assert rows["rm"]["anatomy"].startswith("n/a") and rows["mag"]["anatomy"].startswith("n/a")
        for view in rows:
            assert rows[view]["held_out_other"] is not None and rows[view]["held_out_first"] is not None
