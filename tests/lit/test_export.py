"""Exporting a run: at the end of `fit` and later from the run folder (the same folders), fine-tuned views
with LoRA merged, and the exported folder evaluated by `fit` gives the run's perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_run import exported_perplexity, tiny_run_args

from ghostdistill.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _args(tiny_dir, text_files, run, *extra):
    recovery = [{"name": "ghost"}, {"name": "linearpatch", "method": "linearpatch", "variant": "diag"}]
    return tiny_run_args(tiny_dir, text_files, run, *extra, recovery=recovery, eval_windows=4)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_fit_exports_and_the_run_folder_exports_the_same(tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    views = ["ghost", "ghost_ft", "linearpatch", "pruned"]
    cli = main(
        _args(
            tiny_dir,
            text_files,
            run,
            "--trainer.max_steps",
            "3",
            "--model.distill.methods",
            "[ghost]",
            "--model.distill.train",
            "[operators, lora]",
            "--model.distill.lr",
            "1e-2",
            "--model.distill.lora.lr",
            "1e-2",
            "--model.distill.keep",
            "last",
            "--export.views",
            json.dumps(views),
        )
    )
    results = json.loads((run / "results.json").read_text())
    at_end = {v: run / "export" / v for v in views}
    for view, folder in at_end.items():
        config = json.loads((folder / "config.json").read_text())
        assert (
            config["ghostdistill"]["metrics"]["held_out"]["ppl"] == results["views"][view]["metrics"]["held_out"]["ppl"]
        )
        assert not any("lora" in k or "base_layer" in k for k in _weights(folder)), "adapters merged, not shipped"
    assert json.loads((at_end["ghost_ft"] / "config.json").read_text())["ghostdistill"]["distill"]["steps"] == 3
    ghost, ghost_ft = _weights(at_end["ghost"]), _weights(at_end["ghost_ft"])
    assert not torch.equal(ghost["gap_operators.0.delta"], ghost_ft["gap_operators.0.delta"])
    q = next(k for k in ghost if k.endswith("layers.1.self_attn.q_proj.weight"))
    assert not torch.equal(ghost[q], ghost_ft[q]), "the LoRA update is merged into the fine-tuned weights"

    # From the finished run folder: the same folders (statistics from calibration_state.pt, the
    # fine-tuned values from checkpoints/last.ckpt).
    again = tmp_path / "again"
    main(["export", str(run), "--views", *views, "--dir", str(again)])
    for view in views:
        a, b = _weights(at_end[view]), _weights(again / view)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-6, msg=f"{view}: {key}")
    with pytest.raises(FileExistsError, match="overwrite"):
        main(["export", str(run), "--views", "ghost", "--dir", str(again)])
    with pytest.raises(
        ValueError,
        match=r"views of .* are \['dense', 'pruned', 'ghost', 'linearpatch', 'ghost_ft'\]",
    ):
        main(["export", str(run), "--views", "linearpatch_ft"])

    # The exported fine-tuned folder, loaded as a user loads it, gives the run's perplexity on the same windows.
    # (As a `fit` source it is refused: a folder with operators is not a model to prune, issue 39.)
    ppl, tokens = exported_perplexity(at_end["ghost_ft"], cli.model.run)
    expected = results["views"]["ghost_ft"]["metrics"]["held_out"]
    assert tokens == expected["tokens"] and ppl == pytest.approx(expected["ppl"], rel=1e-5)


def test_export_names_bad_views_before_the_run(tiny_dir, text_files, tmp_path):
    with pytest.raises(ValueError, match=r"export.views \['ghots'\] are not views of this run"):
        main(_args(tiny_dir, text_files, tmp_path / "run", "--export.views", "[ghots]"))
    assert not (tmp_path / "run" / "results.json").exists()


def test_a_stock_student_that_trains_its_rotation_exports_stock_from_the_run_and_its_folder(
    tiny_dir, text_files, tmp_path
):
    """A `rotation_anchored` student whose recovery has its own name trains c·Q within the scaled rotations
    (the run tells the students each recovery name's method): after 3 steps its folder, written at the end of
    `fit` and again from the run folder, is the plain architecture (no `auto_map`, no operator), loads with a
    plain `from_pretrained`, differs from the closed form's, and scores the run's perplexity."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    student = {"name": "ra_ft", "method": "ra", "train": ["operators", "lora"]}
    args = tiny_run_args(
        tiny_dir, text_files, run, recovery=[{"name": "ra", "method": "rotation_anchored"}], eval_windows=4
    )
    main(
        [
            *args,
            "--trainer.max_steps",
            "3",
            "--model.distill.students",
            json.dumps([student]),
            "--model.distill.lr",
            "1e-2",
            "--model.distill.keep",
            "last",
            "--export.views",
            '["ra", "ra_ft"]',
        ]
    )
    results = json.loads((run / "results.json").read_text())
    folders = {v: run / "export" / v for v in ("ra", "ra_ft")}
    for folder in folders.values():
        config = json.loads((folder / "config.json").read_text())
        assert "auto_map" not in config and config["architectures"] == ["LlamaForCausalLM"]
        assert not any("gap_operators" in k or "lora" in k for k in _weights(folder))
        AutoModelForCausalLM.from_pretrained(folder)  # a plain load, no remote code
    embed = next(k for k in _weights(folders["ra"]) if k.endswith("embed_tokens.weight"))
    assert not torch.equal(_weights(folders["ra"])[embed], _weights(folders["ra_ft"])[embed]), "the trained Q is folded"
    again = tmp_path / "again"
    main(["export", str(run), "--views", "ra_ft", "--dir", str(again)])
    a, b = _weights(folders["ra_ft"]), _weights(again / "ra_ft")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-6, msg=key)
    check = tmp_path / "check"
    main(
        tiny_run_args(
            folders["ra_ft"],
            text_files,
            check,
            layers=(1,),
            recovery=[{"name": "none", "method": "none"}],
            eval_windows=4,
        )
    )
    reloaded = json.loads((check / "results.json").read_text())["views"]["dense"]["metrics"]["held_out"]
    assert reloaded["ppl"] == pytest.approx(results["views"]["ra_ft"]["metrics"]["held_out"]["ppl"], rel=1e-5)
