"""What applies to which family (issue 53): every shipped method on a tiny model of every family is either
accepted and fitted, or refused before calibration in one line naming the method, the family, the reason and the
methods that apply (`Method.supports`, `methods.check_family`; the table in docs/reliability.md)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import GEMMA, TINY_FAMILIES, tiny_model
from tiny_run import tiny_run_args

import ghostdistill
from ghostdistill.cli import entry, main
from ghostdistill.core.anatomy import decoder_stack
from ghostdistill.core.errors import GhostdistillError
from ghostdistill.data.run import RunData
from ghostdistill.methods import RecoveryConfig, applicable, check_family, family_facts, registered
from ghostdistill.methods.hadamard import has_hadamard
from ghostdistill.pipeline import frontier
from ghostdistill.pipeline import run as run_phases
from ghostdistill.pipeline.config import RunConfig
from ghostdistill.planning import PlanConfig

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "smollm2_demo.yaml")
FAMILIES = (*TINY_FAMILIES, GEMMA)
# (family, method) → what the refusal names as the reason; every other pair applies.
REFUSED = {
    (GEMMA, "rotation_through"): r"its fold into the stock weights is not exact for Gemma3DecoderLayer: it has "
    r"norms inside the residual branch \(pre_feedforward_layernorm, post_feedforward_layernorm\)",
    (GEMMA, "rotation_anchored"): r"its fold into the stock weights is not exact for Gemma3DecoderLayer",
}
# ReplaceMe applies to Gemma 3 although its fit assumes no norm after the MLP: measured, it beats no repair there.
GEMMA_APPLIES = (
    "ghost, ghost_symmetric, linearpatch, magnitude, none, replaceme, rotation (stock checkpoints: magnitude, none, "
    "replaceme;"
)


def test_family_every_method_applies_to_the_pre_norm_families_and_all_but_the_folding_rotations_to_gemma():
    for family in FAMILIES:
        expected = GEMMA_APPLIES.split(" (")[0].split(", ") if family == GEMMA else sorted(registered())
        assert sorted(applicable(family_facts(tiny_model(family, num_layers=2)))) == expected, family


@pytest.mark.parametrize("method", sorted(registered()))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_each_method_is_fitted_or_refused_before_calibration(
    family, method, tiny_tokenizer, text_corpus, tmp_path, monkeypatch
):
    calibrated = []
    real = run_phases.calibrate

    def spy(*args, **kwargs):
        calibrated.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(run_phases, "calibrate", spy)
    model = tiny_model(family, num_layers=6)
    work = tmp_path / "run"
    options = dict(layers=[2, 3], num_samples=8, seq_len=16, workdir=work, progress=False, verbose=False)
    calibration = text_corpus[:20]
    if (family, method) in REFUSED:
        with pytest.raises(GhostdistillError) as err:
            ghostdistill.repair(model, tiny_tokenizer, method=method, calibration=calibration, **options)
        line = str(err.value)
        assert "\n" not in line, line
        assert re.search(rf"recovery\[0\] '{method}' \({method}\) cannot be right on gemma3_text: ", line), line
        assert re.search(REFUSED[family, method], line), line
        assert f"The methods that apply to gemma3_text: {GEMMA_APPLIES}" in line, line
        assert not calibrated and not (work / "calibration_state.pt").exists()
        return
    repaired = ghostdistill.repair(model, tiny_tokenizer, method=method, calibration=calibration, **options)
    assert calibrated and (work / "calibration_state.pt").exists()
    assert len(decoder_stack(repaired).layers) == 4
    with torch.no_grad():
        logits = repaired(input_ids=torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))).logits
    assert torch.isfinite(logits).all()


def test_family_fit_refuses_every_wrong_entry_in_one_line_before_any_data(gemma_dir, tmp_path, capsys, monkeypatch):
    """Through `fit` on a saved tiny Gemma 3: both rotations refused in one line, no calibration text read."""

    def refuse(*args, **kwargs):
        raise AssertionError("calibration text was read before the refusal")

    monkeypatch.setattr(RunData, "calibration_ids", refuse)
    run = tmp_path / "run"
    recovery = "[{name: g, method: ghost}, {name: rt, method: rotation_through}, {name: ra, method: rotation_anchored}]"
    argv = ["fit", "--config", DEMO, "--model.model.source", str(gemma_dir)]
    argv += ["--model.plan.layers", "[2,3]", "--model.plan.num_layers", "null", "--model.recovery", recovery]
    argv += ["--trainer.default_root_dir", str(run), "--calibration.progress", "false"]
    monkeypatch.setattr(sys, "argv", ["ghostdistill", *argv])
    monkeypatch.delenv("GHOSTDISTILL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        entry()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and lines[-1].startswith("error: "), lines[-5:]
    assert lines[-1].startswith(
        "error: recovery[1] 'rt' (rotation_through), recovery[2] 'ra' (rotation_anchored) cannot be right on "
        "gemma3_text: its fold into the stock weights is not exact for Gemma3DecoderLayer"
    ), lines[-1]
    assert "'g' (ghost)" not in lines[-1] and not (run / "calibration_state.pt").exists()


def test_family_the_plan_repair_method_is_checked_too():
    cfg = RunConfig(
        plan=PlanConfig(criterion="repair", num_layers=2, repair_method="rotation_through"),
        recovery=[RecoveryConfig(name="g", method="ghost")],
    )
    with pytest.raises(
        ValueError, match=r"^plan.repair_method 'rotation_through' \(rotation_through\) cannot be right on gemma3_text"
    ):
        cfg.check_family(tiny_model(GEMMA, num_layers=4))
    cfg.check_family(tiny_model("llama", num_layers=4))


def test_family_facts_from_the_config_alone_equal_the_loaded_model():
    """A meta-device skeleton (no weights) gives the same facts: the check can run before the weights load."""
    from transformers import AutoModelForCausalLM

    for family in FAMILIES:
        model = tiny_model(family, num_layers=2)  # its config: what `AutoConfig.from_pretrained` gives
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        loaded, meta = family_facts(model), family_facts(skeleton)
        assert (meta.model_type, meta.block_class) == (loaded.model_type, loaded.block_class)
        assert applicable(meta) == applicable(loaded)


def test_family_linearpatch_rotate_without_a_hadamard_size_is_refused_and_diag_applies():
    facts = family_facts(tiny_model("llama", num_layers=2))
    size = next(n for n in range(64, 4096, 4) if not has_hadamard(n))
    odd = type(facts)(model_type="llama", block=facts.block, hidden_size=size)
    with pytest.raises(ValueError, match=rf"variant 'rotate' needs a Hadamard matrix of the hidden size {size}"):
        check_family([RecoveryConfig(name="lp", method="linearpatch")], odd)
    check_family([RecoveryConfig(name="lp", method="linearpatch", variant="diag")], odd)


@pytest.fixture
def gemma_dir(tmp_path, tiny_tokenizer):
    folder = tmp_path / "gemma"
    tiny_model(GEMMA).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_family_frontier_refuses_before_any_depth(gemma_dir, text_files, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a frontier depth was planned before the refusal")

    monkeypatch.setattr(frontier, "frontier_point", refuse)
    recovery = [{"name": "rt", "method": "rotation_through"}]
    args = tiny_run_args(gemma_dir, text_files, tmp_path / "unused", layers=None, num_layers=2, recovery=recovery)
    spec = tmp_path / "frontier.yaml"
    spec.write_text(yaml.safe_dump({"base": args[2], "root": str(tmp_path / "f"), "num_layers": [1, 2]}))
    overrides = args[3:] + ["--data.selection.source", json.dumps({"source": str(text_files["txt"])})]
    with pytest.raises(ValueError, match=r"^recovery\[0\] 'rt' \(rotation_through\) cannot be right on gemma3_text"):
        main(["frontier", str(spec), *overrides])
    assert not list((tmp_path / "f").glob("points/*.json"))
