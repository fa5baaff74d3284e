"""The Python API (`ghostdistill.repair`, `plan`, `evaluate`, `distill_student`) on the tiny LLaMA: every call
equals `fit` (plus `export`) of the same settings, the source model comes back as it was given, in-memory
text reads as the file `fit` reads, mistakes are one `GhostdistillError` line before any work, and quiet
calls print nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_run import ROOT, tiny_run_args
from transformers import AutoModelForCausalLM, AutoTokenizer

import ghostdistill
from ghostdistill.cli import main
from ghostdistill.core.modeling_ghostdistill import GhostPrunedForCausalLM

QUIET = {"progress": False, "verbose": False, "num_samples": 16, "seq_len": 32}
SMALL = {"layers": [2, 3], **QUIET}


@pytest.fixture(scope="module")
def fitted(tiny_dir, text_files, tmp_path_factory):
    """`fit` of ghost and rotation_anchored on layers 2-3 (the tiny run's settings), both views exported."""
    run = tmp_path_factory.mktemp("fit") / "run"
    recovery = [{"name": "ghost"}, {"name": "rotation_anchored", "method": "rotation_anchored"}]
    main(tiny_run_args(tiny_dir, text_files, run, "--export.views", "[ghost, rotation_anchored]", recovery=recovery))
    return run


@pytest.fixture
def tiny(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def calibration_texts(text_files) -> list[str]:
    """The documents of the tiny run's calibration file, as a user holds them in memory."""
    import gzip

    with gzip.open(text_files["jsonl_gz"], "rt") as f:
        return [json.loads(line)["text"] for line in f]


def saved(model, folder):
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("method", ["ghost", "rotation_anchored"])
def test_repair_saves_what_fit_plus_export_writes(fitted, tiny, text_files, tmp_path, method):
    model, tok = tiny
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        dense = model(ids).logits
    repaired = ghostdistill.repair(model, tok, method=method, calibration=calibration_texts(text_files), **SMALL)
    stock = method == "rotation_anchored"
    assert isinstance(repaired, GhostPrunedForCausalLM) != stock
    assert repaired.config.num_hidden_layers == 4
    ours, theirs = saved(repaired, tmp_path / "ours"), load_file(fitted / "export" / method / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (tmp_path / "ours" / "modeling_ghostdistill.py").is_file() != stock
    # The folder reloads as export's does, and the model generates.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=not stock).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, repaired(ids).logits, rtol=0, atol=0)
    assert repaired.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 12)
    # The source model is as it was given: every block, no hooks, the same logits.
    assert len(model.model.layers) == model.config.num_hidden_layers == 6
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense)


def test_a_dataset_and_a_file_calibrate_as_the_same_texts_in_a_list(tiny, text_files, tmp_path):
    from datasets import Dataset

    model, tok = tiny
    texts = calibration_texts(text_files)
    listed = ghostdistill.repair(model, tok, calibration=texts, **SMALL).state_dict()
    table = Dataset.from_dict({"body": texts, "n": list(range(len(texts)))})
    for calibration, extra in ((table, {"text_field": "body"}), (str(text_files["jsonl_gz"]), {})):
        other = ghostdistill.repair(model, tok, calibration=calibration, **SMALL, **extra).state_dict()
        assert all(torch.equal(listed[k], other[k]) for k in listed)


def test_evaluate_and_plan_give_fits_numbers_and_plan(fitted, tiny, text_files):
    model, tok = tiny
    results = ghostdistill.evaluate(
        model,
        tok,
        methods=["ghost", "rotation_anchored"],
        calibration=calibration_texts(text_files),
        texts={"held_out": str(text_files["txt"])},
        eval_seq_len=32,
        max_windows=2,
        **SMALL,
    )
    theirs = json.loads((fitted / "results.json").read_text())["views"]
    assert list(results["views"]) == list(theirs) == ["dense", "pruned", "ghost", "rotation_anchored"]
    for view, entry in theirs.items():
        for key, value in entry["metrics"]["held_out"].items():
            assert results["views"][view]["metrics"]["held_out"][key] == pytest.approx(value, rel=1e-5), (view, key)
    chosen = ghostdistill.plan(model, tok, 2, "block_influence", calibration=calibration_texts(text_files), **QUIET)
    assert len(chosen.removed) == 2 and chosen.chosen_by == "block_influence" and len(chosen.scores) == 4
    again = ghostdistill.repair(
        model, tok, 2, "ghost", calibration_texts(text_files), criterion="block_influence", **QUIET
    )
    assert again.config.ghostdistill["plan"]["removed"] == list(chosen.removed)


def test_distill_student_is_fits_student(tiny_dir, tiny, text_files, tmp_path):
    main(
        tiny_run_args(
            tiny_dir, text_files, tmp_path / "fit",
            "--trainer.max_steps", "3", "--model.distill.methods", "[ghost]", "--export.views", "[ghost_ft]",
        )
    )  # fmt: skip
    model, tok = tiny
    student = ghostdistill.distill_student(model, tok, calibration=calibration_texts(text_files), steps=3, **SMALL)
    ours, theirs = (
        saved(student, tmp_path / "ours"),
        load_file(tmp_path / "fit" / "export" / "ghost_ft" / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    repaired = ghostdistill.repair(model, tok, calibration=calibration_texts(text_files), **SMALL)
    assert not torch.equal(student.gap_operators[0].delta, repaired.gap_operators[0].delta)  # it trained


def test_quiet_calls_print_nothing_and_bars_show_when_asked(tiny, text_files, capfd):
    model, tok = tiny
    ghostdistill.repair(model, tok, calibration=calibration_texts(text_files), **SMALL)
    out, err = capfd.readouterr()
    assert out == "" and "it/s" not in err, (out, err)
    ghostdistill.repair(model, tok, calibration=calibration_texts(text_files), **{**SMALL, "verbose": True})
    assert "remove layers [2, 3]" in capfd.readouterr().out
    ghostdistill.repair(model, tok, calibration=calibration_texts(text_files), **{**SMALL, "progress": True})
    assert "calibration statistics: 100%" in capfd.readouterr().err  # tqdm.auto's bar (a widget in a notebook)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, t: ghostdistill.repair(m, t, num_layers=9), "cannot remove 9 contiguous layers"),
        (lambda m, t: ghostdistill.repair(m, t, method="nope"), "recovery method 'nope' is not known"),
        (lambda m, t: ghostdistill.repair(m, t, number_layers=2), "unknown keywords ['number_layers']"),
        (lambda m, t: ghostdistill.repair(m, t, calibration=[1, 2]), "a list of int is not text"),
        (lambda m, t: ghostdistill.repair(m, t, 2, calibration=["too short"]), "windows of 2048 tokens"),
        (lambda m, t: ghostdistill.repair(m, t, layers=[0, 1]), "removes the first or last layer"),
        (lambda m, t: ghostdistill.distill_student(m, t, steps=0), "at least one step"),
        (lambda m, t: ghostdistill.distill_student(m, t, trainer={"gradient_clip": 1}), "['gradient_clip'] are not"),
        (lambda m, t: ghostdistill.distill_student(m, t, trainer={"max_steps": 9}), "the API's steps"),
        (lambda m, t: ghostdistill.repair("/no/such/model", method="nope"), "recovery method 'nope'"),
    ],
)
def test_mistakes_are_one_line_ghostdistill_errors(tiny, call, message):
    """`fit`'s one-line messages, as one exception type (a ValueError); a bad setting is found before the model
    loads (the missing folder of the last case is never read)."""
    model, tok = tiny
    with pytest.raises(ghostdistill.GhostdistillError) as info:
        call(model, tok)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_import_ghostdistill_stays_light():
    """The API is imported on first use: `import ghostdistill` (and so the command line's start) loads no torch."""
    code = "import sys, ghostdistill; print('torch' in sys.modules); print(callable(ghostdistill.repair))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True"]


def test_conversations_are_a_chat_source(tmp_path):
    """A list of conversations (lists of messages) becomes `fit`'s chat source of a JSONL file of them."""
    from ghostdistill.api.options import Options, text_source

    conversations = [
        [{"role": "user", "content": "How do I boil an egg?"}, {"role": "assistant", "content": "In water."}],
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]
    source = text_source(conversations, "calibration", Options(), tmp_path)
    assert source.chat is not None and source.name == "calibration"
    lines = [json.loads(line) for line in Path(source.source).read_text().splitlines()]
    assert [line["messages"] for line in lines] == conversations
    assert text_source(conversations, "calibration", Options(), tmp_path).source == source.source  # by content
