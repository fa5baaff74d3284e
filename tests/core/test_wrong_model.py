"""A wrong model (issue 39): a folder `export` wrote with operators is a pruned model with its repair, not a model
to prune again; as `model.model.source` it is refused in one line before the model loads, naming what to pass
instead. A plain or folded (stock) export is the family's own architecture and stays usable as a source. A
folder that does not load whole is an error naming the tensors, never a half-initialised model."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import fit_all, tiny_config, tiny_model
from tiny_run import tiny_run_args

from ghostdistill.cli import entry, main
from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import export_view, load_exported
from ghostdistill.methods import RecoveryConfig

METHODS = [RecoveryConfig(name="ghost"), RecoveryConfig(name="rt", method="rotation_through")]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_tokenizer):
    """The tiny LLaMA's ghost (operators), pruned (plain) and rotation_through (folded) views, exported."""
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), METHODS)
    root = tmp_path_factory.mktemp("exports")
    info = {"base_model": "tiny-llama-base"}
    return {
        view: export_view(pm, view, root / view, method=method, tokenizer=tiny_tokenizer, info=info)
        for view, method in (("ghost", "ghost"), ("pruned", None), ("rt", "rotation_through"))
    }


def test_wrong_model_an_operator_export_as_source_is_refused_before_the_model_loads(
    exports, text_files, tmp_path, capsys, monkeypatch
):
    from ghostdistill.pipeline import run

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run, "load_model", never)
    args = tiny_run_args(exports["ghost"], text_files, tmp_path / "run", layers=(1,))
    monkeypatch.setattr(sys, "argv", ["ghostdistill", *args])
    monkeypatch.delenv("GHOSTDISTILL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        entry()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    line = err[0]
    assert f"model.model.source '{exports['ghost']}' is a ghostdistill export with operators" in line
    assert "base_model_type 'llama'" in line and "blocks [2, 3] removed" in line
    assert "pass its base model (model.model.source 'tiny-llama-base')" in line and "stock checkpoint" in line
    assert not (tmp_path / "run" / "calibration_state.pt").exists()


@pytest.mark.parametrize("view", ["pruned", "rt"])
def test_wrong_model_a_plain_or_folded_export_is_an_ordinary_source(exports, view, text_files, tmp_path):
    """The pruned (plain) and rotation_through (folded) exports load as the family's own model and are pruned
    and repaired again like any other: their dense perplexity is the exported view's."""
    run = tmp_path / "run"
    main(tiny_run_args(exports[view], text_files, run, "--model.evaluation.analysis", "false", layers=(1,)))
    results = json.loads((run / "results.json").read_text())
    assert results["model"]["source"] == str(exports[view])
    assert set(results["views"]) == {"dense", "pruned", "ghost"}
    config = json.loads((exports[view] / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 4


def test_wrong_model_a_folder_that_does_not_load_whole_is_refused_naming_the_tensors(exports, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ghost"
    import shutil

    shutil.copytree(exports["ghost"], folder)
    weights = load_file(folder / "model.safetensors")
    dropped = "gap_operators.0.delta"
    weights.pop(dropped)
    weights["pruned.model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not load whole .* 1 missing \(e.g. \['gap_operators.0.delta'\]\)"):
        load_exported(folder)
    with pytest.raises(ValueError, match=r"1 unexpected \(e.g. \['pruned.model.layers.9.extra.weight'\]\)"):
        load_exported(folder)
    load_exported(exports["ghost"])  # whole: loads


def test_wrong_model_a_tied_export_loads_whole(tmp_path, tiny_tokenizer):
    """A tied head is not in the folder (the loader ties it again): not a missing tensor."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    pm, _ = fit_all(model, PruningPlan.from_layers([2, 3], 6), METHODS[:1])
    for view, method in (("ghost", "ghost"), ("pruned", None)):
        folder = export_view(pm, view, tmp_path / view, method=method, tokenizer=tiny_tokenizer)
        loaded = load_exported(folder)
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
