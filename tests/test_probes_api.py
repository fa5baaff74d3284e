"""Issue 53's probes of the Python API, each answered in one line before any work or with the right behaviour:
a model that `repair` returned with operators given back to the API (it ran and was called "dense", or printed a
12,000-character list of model identifiers), and counts that are not whole numbers (`steps=1.5` trained two
steps and wrote no last.ckpt)."""

from __future__ import annotations

import gzip
import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import ghostdistill

QUIET = {"progress": False, "verbose": False, "num_samples": 16, "seq_len": 32}


def _calibration(text_files) -> list[str]:
    with gzip.open(text_files["jsonl_gz"], "rt") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def repaired(tiny_dir, text_files):
    """The tiny LLaMA repaired by ghost (operators: a `GhostPrunedForCausalLM`), with its tokenizer."""
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)
    model.name_or_path = "tiny-base"
    return ghostdistill.repair(model, tok, calibration=_calibration(text_files), layers=[2, 3], **QUIET), tok


@pytest.mark.parametrize(
    "call",
    [
        lambda m, t: ghostdistill.evaluate(m, t, 1, texts=["some text"], **QUIET),
        lambda m, t: ghostdistill.plan(m, t, 1, **QUIET),
        lambda m, t: ghostdistill.repair(m, None, 1, **QUIET),  # no tokenizer: was a list of 12,000 characters
        lambda m, t: ghostdistill.distill_student(m, t, 1, steps=1, **QUIET),
    ],
    ids=["evaluate", "plan", "repair", "distill_student"],
)
def test_a_model_repaired_with_operators_is_refused_in_one_line_naming_what_to_pass(repaired, call, tmp_path):
    model, tok = repaired
    with pytest.raises(ghostdistill.GhostdistillError) as info:
        call(model, tok)
    line = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in line and len(line) < 600, line
    assert line.startswith("model GhostPrunedForCausalLM is a model repaired with operators"), line
    assert "base_model_type 'llama'" in line and "blocks [2, 3] removed" in line, line
    assert "pass its base model (the model it was repaired from, 'tiny-base')" in line and "stock checkpoint" in line
    assert model.config.num_hidden_layers == 4 and len(model.pruned.model.layers) == 4  # left as it was given


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ghostdistill.distill_student("/no/such/model", steps=1.5), "distill_student() steps=1.5: "),
        (
            lambda: ghostdistill.distill_student("/no/such/model", train_samples=8.5),
            "distill_student() train_samples=8.5: ",
        ),
        (lambda: ghostdistill.repair("/no/such/model", num_layers=2.5), "repair() num_layers=2.5: "),
        (lambda: ghostdistill.plan("/no/such/model", num_layers=2.0), "plan() num_layers=2.0: "),
        (lambda: ghostdistill.evaluate("/no/such/model", max_windows=1.5), "evaluate() max_windows=1.5: "),
        (lambda: ghostdistill.evaluate("/no/such/model", eval_seq_len="64"), "evaluate() eval_seq_len='64': "),
        (lambda: ghostdistill.repair("/no/such/model", num_samples=16.0), "repair() num_samples=16.0: "),
        (lambda: ghostdistill.repair("/no/such/model", seq_len=True), "repair() seq_len=True: "),
        (lambda: ghostdistill.repair("/no/such/model", layers=[2.0, 3]), "repair() layers=2.0: "),
    ],
)
def test_counts_that_are_not_whole_numbers_are_refused_before_the_model_loads(call, message):
    """Each names the argument, its value and what it takes; the missing model folder is never read."""
    with pytest.raises(ghostdistill.GhostdistillError) as info:
        call()
    line = str(info.value)
    assert line.startswith(message) and "takes a whole number (an int such as" in line and "\n" not in line, line
