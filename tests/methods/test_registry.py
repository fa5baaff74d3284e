"""Adding a method is one module and one registry entry: a toy method registered here runs through
calibration, the fit and the report like the shipped ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_extending import MeanScale as ScaleStatistics
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.core.operator import GhostOperator
from ghostdistill.core.plan import Gap
from ghostdistill.methods import (
    GapFit,
    Method,
    RecoveryConfig,
    get_method,
    register,
    registered,
    unregister,
    validate_recovery,
)

ROOT = Path(__file__).resolve().parents[2]


class ToyScale(Method):
    name = "toy_scale"

    def collector(self, hidden_size, device):
        return ScaleStatistics(hidden_size, device)

    def validate(self, cfg: RecoveryConfig) -> None:
        pass

    def fit(self, cfg: RecoveryConfig, gap: Gap, stats: ScaleStatistics, hidden_size: int) -> GapFit:
        op = GhostOperator(hidden_size)
        op.load_solution((stats.cross / stats.square - 1.0) * torch.eye(hidden_size, dtype=torch.float64))
        return GapFit(operator=op)

    def identity(self, cfg: RecoveryConfig, hidden_size: int) -> GapFit:
        return GapFit(operator=GhostOperator(hidden_size))


@pytest.fixture
def toy():
    method = register(ToyScale())
    yield method
    unregister(method.name)


def test_shipped_methods_implement_the_interface():
    assert set(registered()) >= {"none", "ghost", "linearpatch", "replaceme", "magnitude"}
    for name in registered():
        method = get_method(name)
        assert isinstance(method, Method) and method.name == name
    assert [get_method(n).folds for n in ("ghost", "linearpatch", "replaceme", "magnitude")] == [
        False,
        False,
        True,
        True,
    ]


def test_unknown_method_is_named_with_the_registered_ones(toy):
    with pytest.raises(ValueError, match="'lora'.*toy_scale"):
        validate_recovery([RecoveryConfig(name="x", method="lora")])
    with pytest.raises(TypeError, match="does not implement"):
        register(object())


def test_a_registered_method_runs_through_calibration_fit_and_report(toy, tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    recovery = [{"name": "ghost"}, {"name": "scaled", "method": "toy_scale"}]
    main(tiny_run_args(tiny_dir, text_files, run, recovery=recovery, samples=8, eval_windows=4, batch_size=None))
    results = json.loads((run / "results.json").read_text())
    assert list(results["views"]) == ["dense", "pruned", "ghost", "scaled"]
    assert results["recovery"]["scaled"]["method"] == "toy_scale"
    scaled, pruned = results["views"]["scaled"], results["views"]["pruned"]
    assert scaled["metrics"]["held_out"]["ppl"] != pruned["metrics"]["held_out"]["ppl"]
    assert scaled["params"] == pruned["params"] + 64 * 64  # one inserted C×C operator
    assert "| scaled |" in (run / "results.md").read_text()
    # Its statistics were collected in the shared pass and saved for resuming like every method's.
    state = torch.load(run / "calibration_state.pt", weights_only=False)
    saved = state["stats"]["2-3"]["toy_scale"]
    assert float(saved["square"]) > 0 and float(saved["cross"]) != 0
