"""Several students per method in one run (`distill.students`): they train independently of each other, each
learns exactly what it would learn alone, the teacher stays exact, and the new kinds (`tail`, `norms`, the
hidden-state term) export and reload to the run's perplexity."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_run import exported_perplexity, tiny_run_args

from ghostdistill.cli import main
from ghostdistill.distill.config import DistillConfig, StudentConfig

TAIL = {
    "name": "ghost_tail_ft",
    "method": "ghost",
    "train": ["operators", "tail"],
    "tail_blocks": 1,
    "block_lr": 1e-3,
}
NORMS = {
    "name": "ghost_norms_ft",
    "method": "ghost",
    "train": ["norms"],
    "norm_lr": 3e-2,
    "loss": {"hidden_weight": 0.5},
}


def _run(tiny_dir, text_files, run, methods, students, *extra):
    args = tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--model.distill.methods",
        json.dumps(methods),
        "--model.distill.students",
        json.dumps(students),
        "--model.distill.lr",
        "1e-3",
        "--model.distill.val_every",
        "1",
        "--model.distill.keep",
        "last",
        "--data.validation.source",
        json.dumps({"source": str(text_files["jsonl_gz"]), "first_document": 150}),
        "--data.validation.num_windows",
        "4",
        "--data.validation.seq_len",
        "32",
        "--trainer.max_steps",
        "3",
        # Training on the validation documents: on the calibration windows the closed form is already optimal
        # and held-out KL only rises (see tests/distill/test_distillation.py).
        "--data.train.source",
        json.dumps({"source": str(text_files["jsonl_gz"]), "first_document": 150}),
        "--data.train.num_samples",
        "16",
        "--data.train.seq_len",
        "32",
        *extra,
        recovery=[{"name": "ghost"}],
        eval_windows=4,
    )
    cli = main(args)
    return cli.model, json.loads((run / "results.json").read_text())


@torch.no_grad()
def _fresh_logits(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.arange(2, 34).view(1, 32)
    return ids, model(input_ids=ids).logits, model


def test_students_of_one_method_train_independently_and_as_they_would_alone(tiny_dir, text_files, tmp_path):
    module, results = _run(
        tiny_dir,
        text_files,
        tmp_path / "all",
        ["ghost"],
        [TAIL, NORMS],
        "--export.views",
        json.dumps(["ghost_tail_ft", "ghost_norms_ft"]),
    )
    views = ["ghost_ft", "ghost_tail_ft", "ghost_norms_ft"]
    assert module.run.students.views == views
    ids, reference, fresh = _fresh_logits(tiny_dir)
    pruned = module.run.pruned
    with torch.no_grad(), pruned.use("dense") as model:
        assert torch.equal(model(input_ids=ids).logits, reference), "the dense teacher changed"
    with torch.no_grad():
        outputs = {}
        for view in ["ghost", *views]:
            with pruned.use(view) as model:
                outputs[view] = model(input_ids=ids).logits
    for a in ["ghost", *views]:
        for b in ["ghost", *views]:
            if a < b:
                assert not torch.equal(outputs[a], outputs[b]), (a, b)

    # No student shares a trainable tensor with another, and each trained what its recipe names.
    params = module.run.students.params
    for a in views:
        for b in views:
            if a != b:
                assert not {id(p) for p in params[a].all()} & {id(p) for p in params[b].all()}, (a, b)
    assert (
        params["ghost_tail_ft"]["tail"] and params["ghost_tail_ft"]["blocks"] and params["ghost_tail_ft"]["operators"]
    )
    assert params["ghost_norms_ft"]["norms"] and not params["ghost_norms_ft"]["operators"]
    assert not params["ghost_ft"]["tail"] and not params["ghost_ft"]["norms"]
    # The tail student's head and final norm are its own and moved; the teacher's are the fresh model's.
    with pruned.use("ghost_tail_ft") as model:
        tail_head = model.get_output_embeddings().weight
        tail_norm = model.model.norm.weight
    assert not torch.equal(tail_head, fresh.get_output_embeddings().weight)
    assert not torch.equal(tail_norm, fresh.model.norm.weight)
    with pruned.use("ghost_norms_ft") as model:
        kept = pruned.plan.kept[-1]
        tuned = model.model.layers[-1].input_layernorm.weight
    assert not torch.equal(tuned, fresh.model.layers[kept].input_layernorm.weight)
    assert torch.equal(
        pruned.dense_layers[kept].input_layernorm.weight, fresh.model.layers[kept].input_layernorm.weight
    )

    # Each student's curve is the one it has when it is the only student of a run.
    history = results["distill"]["history"]
    for spec in (TAIL, NORMS):
        _, alone = _run(tiny_dir, text_files, tmp_path / spec["name"], [], [spec])
        own = alone["distill"]["history"]
        assert [h["step"] for h in own] == [h["step"] for h in history] == [0, 1, 2, 3]
        kl = [h[spec["name"]]["kl"] for h in history]
        assert kl[-1] < kl[0], (spec["name"], kl)
        assert [h[spec["name"]]["kl"] for h in own] == pytest.approx(kl, rel=1e-5, abs=1e-7)
    resolved = results["distill"]["resolved"]
    assert resolved["ghost_tail_ft"]["tail_blocks"] == 1 and resolved["ghost_tail_ft"]["trainable_params"] > 0
    assert resolved["ghost_norms_ft"]["loss"]["hidden_weight"] == 0.5

    # The exported folders, loaded as a user loads them and scored on the run's windows, give the run's
    # perplexity; the tail student's head is untied from the embedding in the folder.
    for view in ("ghost_tail_ft", "ghost_norms_ft"):
        ppl, tokens = exported_perplexity(tmp_path / "all" / "export" / view, module.run)
        expected = results["views"][view]["metrics"]["held_out"]
        assert tokens == expected["tokens"]
        assert ppl == pytest.approx(expected["ppl"], rel=1e-5), view
    if fresh.config.tie_word_embeddings:
        config = json.loads((tmp_path / "all" / "export" / "ghost_tail_ft" / "config.json").read_text())
        assert config["text_config"]["tie_word_embeddings"] is False
        extra = fresh.get_output_embeddings().weight.numel()
        assert results["views"]["ghost_tail_ft"]["params"] == results["views"]["ghost"]["params"] + extra
    assert results["views"]["ghost_norms_ft"]["params"] == results["views"]["ghost"]["params"]
    # From the finished run folder (statistics and the checkpoint's students), the same folders.
    again = tmp_path / "again"
    main(["export", str(tmp_path / "all"), "--views", "ghost_tail_ft", "ghost_norms_ft", "--dir", str(again)])
    for view in ("ghost_tail_ft", "ghost_norms_ft"):
        a, b = _weights(tmp_path / "all" / "export" / view), _weights(again / view)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-6, msg=f"{view}: {key}")

    # The study script on this run: every student's row, its cost measured alone, the plot.
    study = _study_module()
    summaries = study.main([str(tmp_path / "all"), "--steps", "1", "--out", str(tmp_path / "study")])
    rows = summaries[0]["rows"]
    assert list(rows) == views
    for view, row in rows.items():
        assert row["seconds_per_step"] > 0 and row["peak_rss_above_start_gib"] >= 0, view
        assert row["ppl"] == results["views"][view]["metrics"]["held_out"]["ppl"]
        assert row["trainable_params"] == sum(p.numel() for p in params[view].all())
    assert (
        rows["ghost_tail_ft"]["extra_inference_params"]
        == results["views"]["ghost_tail_ft"]["params"] - results["views"]["ghost"]["params"]
    )
    assert (tmp_path / "study" / "students_all.png").is_file()
    assert "| ghost_tail_ft | operators, tail, k=1 |" in (tmp_path / "study" / "students.md").read_text()


def _weights(folder):
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _study_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "studies" / "study_students.py"
    spec = importlib.util.spec_from_file_location("study_students", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tokens_to_reach_interpolates_between_validations():
    study = _study_module()
    history = [{"step": 0, "a": {"kl": 1.0}}, {"step": 10, "a": {"kl": 0.6}}, {"step": 20, "a": {"kl": 0.4}}]
    assert study.tokens_to_reach(history, "a", 0.5, 100) == pytest.approx(1500.0)
    assert study.tokens_to_reach(history, "a", 1.2, 100) == 0.0
    assert study.tokens_to_reach(history, "a", 0.3, 100) is None


def test_the_head_start_is_measured_both_ways():
    study = _study_module()
    history = [
        {"step": 0, "ghost_ft": {"kl": 0.4}, "linearpatch_ft": {"kl": 0.8}},
        {"step": 10, "ghost_ft": {"kl": 0.3}, "linearpatch_ft": {"kl": 0.6}},
        {"step": 20, "ghost_ft": {"kl": 0.25}, "linearpatch_ft": {"kl": 0.35}},
    ]
    out = study.head_start(history, 100, 20)
    # linearpatch_ft ends at 0.35: ghost_ft (0.4 at step 0, 0.3 at step 10) gets there at step 5.
    reach = out["ghost_ft_tokens_to_linearpatch_ft_final_kl"]
    assert reach["target_val_kl"] == 0.35 and reach["tokens"] == pytest.approx(500.0)
    # ghost's closed form (0.4) is reached by linearpatch_ft between steps 10 (0.6) and 20 (0.35): step 18.
    back = out["linearpatch_ft_tokens_to_ghost_start_kl"]
    assert back["target_val_kl"] == 0.4 and back["run_tokens"] == 2000
    assert back["tokens"] == pytest.approx(1800.0)
    history[-1]["linearpatch_ft"]["kl"] = 0.5  # never gets there within the run
    assert study.head_start(history, 100, 20)["linearpatch_ft_tokens_to_ghost_start_kl"]["tokens"] is None


@pytest.mark.parametrize(
    "students, match",
    [
        ([{"name": "ghost_tail", "method": "ghost"}], r"distill.students\[0\].name 'ghost_tail' must end in '_ft'"),
        ([{"name": "x_ft", "method": "nope"}], r"distill.students\[0\].method 'nope' is not a recovery name"),
        ([{"name": "ghost_ft", "method": "ghost"}], r"students \['ghost_ft'\] are named twice"),
        ([{"name": "a_ft", "method": "ghost", "train": ["lora", "tail"]}], r"a_ft\): train \['lora', 'tail'\] adapt"),
        ([{"name": "a_ft", "method": "ghost", "train": ["heads"]}], r"a_ft\): train \['heads'\] must be"),
        ([{"name": "a_ft", "method": "ghost", "tail_blocks": -1}], r"tail_blocks must be >= 0"),
        ([{"name": "a_ft", "method": "ghost", "loss": {"hidden_weight": -1}}], r"hidden_weight must be >= 0"),
        ([{"name": "a_ft", "method": "ghost", "loss": {"hidden_kind": "l1"}}], r"hidden_kind 'l1' is not known"),
    ],
)
def test_bad_students_are_named(students, match):
    from ghostdistill.distill.loss import LossConfig

    specs = [StudentConfig(**{**s, "loss": LossConfig(**s["loss"]) if "loss" in s else None}) for s in students]
    with pytest.raises(ValueError, match=match):
        DistillConfig(methods=["ghost"], students=specs).validate(["ghost", "linearpatch"])


def test_unset_student_fields_take_the_run_wide_recipe():
    cfg = DistillConfig(
        methods=["ghost"],
        students=[StudentConfig(name="lp_lora_ft", method="linearpatch", train=["lora"], lr=5e-3)],
        train=["operators"],
        lr=1e-4,
        block_lr=2e-5,
    )
    cfg.validate(["ghost", "linearpatch"])
    ghost, lp = cfg.specs()
    assert (ghost.name, ghost.method, ghost.train, ghost.lr) == ("ghost_ft", "ghost", ("operators",), 1e-4)
    assert (lp.name, lp.method, lp.train, lp.lr, lp.block_lr) == ("lp_lora_ft", "linearpatch", ("lora",), 5e-3, 2e-5)
    assert lp.lora == cfg.lora and lp.lora is not cfg.lora  # its own copy
    assert cfg.method_of("lp_lora_ft") == "linearpatch" and cfg.method_of("ghost") is None


@pytest.mark.parametrize("method", ["ghost", "magnitude"])  # an operator folder and a plain one
def test_a_tail_student_of_a_tied_model_exports_untied_and_reloads_to_its_logits(method, tmp_path):
    """SmolLM2 ties its head to the embedding: a tail student's own head must leave the folder untied, or the
    loader would tie the trained head back to the embedding."""
    from conftest import fit_all, tiny_config

    from ghostdistill.core.plan import PruningPlan
    from ghostdistill.export import export_view, load_exported
    from ghostdistill.methods import RecoveryConfig
    from ghostdistill.pipeline.train import build_students

    torch.manual_seed(0)
    config = tiny_config("llama", 6)
    config.tie_word_embeddings = True
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # as conftest.tiny_model: blocks that really change the residual stream
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    pm, _ = fit_all(model, PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name=method, method=method)])
    cfg = DistillConfig(students=[StudentConfig(name="t_ft", method=method, train=["tail"], tail_blocks=1)])
    cfg.validate([method])
    students = build_students(pm, cfg)
    with torch.no_grad():
        for p in students.params["t_ft"]["tail"]:
            p.add_(0.05 * torch.randn_like(p))
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.arange(3, 30).view(1, 27)
    with torch.no_grad(), pm.use("t_ft") as m:
        want = m(input_ids=ids).logits
        assert m.get_output_embeddings().weight is not m.get_input_embeddings().weight
    folder = export_view(pm, "t_ft", tmp_path / "t_ft", method=method)
    reloaded = load_exported(folder)
    assert reloaded.get_output_embeddings().weight.data_ptr() != reloaded.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(reloaded.get_input_embeddings().weight, embedding)  # the embedding is the teacher's
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), pm.use("dense") as m:
        assert m.get_output_embeddings().weight is m.get_input_embeddings().weight  # the teacher is still tied
