"""Weights off the device (`model.model.offload`: cpu, disk) on tiny models: every phase equal to the model held
in memory, bit for bit in float32 (statistics, operators, plans, perplexities and KL, the alignment analysis,
exported tensors and GGUF bytes); one block on the device at a time, counted from hooks inside the passes, and
each block loaded once per pass; distillation refused in one line."""

from __future__ import annotations

import torch
from conftest import random_batches, tiny_model

from ghostdistill.core.model import ModelConfig, decoder_stack, load_model
from ghostdistill.core.offload import materialised, model_device
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.calibrate import calibrate
from ghostdistill.pipeline.evaluate import analysis, evaluate
from ghostdistill.planning import PlanConfig

RECOVERY = [
    RecoveryConfig(name="ghost"),  # sequential: student passes at the second gap
    RecoveryConfig(name="rot", method="rotation_anchored"),
    RecoveryConfig(name="rm", method="replaceme"),  # a map inside the block before each gap
]
METHODS = {"ghost": "ghost", "rot": "rotation_anchored", "rm": "replaceme"}
PLAN = PlanConfig(layers=[1, 3, 4], num_layers=None)  # two gaps: [1] and [3, 4]
MODES = ("none", "cpu", "disk")


def same(a, b) -> bool:
    """Equal to the bit: tensors by `torch.equal`, containers entry by entry."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def saved_model(tmp_path_factory, family: str = "llama", tied: bool = False) -> str:
    folder = tmp_path_factory.mktemp(f"offload_{family}")
    model = tiny_model(family, num_layers=6)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(folder)
    return str(folder)


def load(folder: str, mode: str):
    model = load_model(ModelConfig(source=folder, offload=mode))
    return model.requires_grad_(False)


def run_phases(folder: str, mode: str, plan: PlanConfig = PLAN, selection=None) -> dict:
    model = load(folder, mode)
    cal = calibrate(model, plan, RECOVERY, random_batches(4), log=lambda m: None, selection=selection)
    windows = {"w": torch.randint(0, 512, (6, 32), generator=torch.Generator().manual_seed(1))}
    pruned = cal.pruned
    return {
        "cal": cal,
        "plan": {k: v for k, v in cal.plan.to_dict().items() if k != "costs"},  # costs: seconds
        "stats": {k: {m: c.state_dict() for m, c in cs.items()} for k, cs in cal.stats.items()},
        "operators": {v: pruned.operators[v].state_dict() for v in pruned.operators},
        "mlp_maps": {v: pruned.mlp_maps[v].state_dict() for v in pruned.mlp_maps},
        "views": evaluate(pruned, pruned.views, windows, 2, methods=METHODS),
        "analysis": analysis(pruned, windows["w"], torch.zeros(1, 32, dtype=torch.long), 2, "w"),
    }


def test_every_phase_equals_the_model_in_memory_bit_for_bit(tmp_path_factory, monkeypatch):
    from ghostdistill.core import executor

    folder = saved_model(tmp_path_factory)
    runs = {mode: run_phases(folder, mode) for mode in ("none", "disk")}
    monkeypatch.setattr(executor, "PASS_BYTES", 1)  # evaluation cut into one pass per batch: the same scores
    runs["cpu"] = run_phases(folder, "cpu")
    assert runs["none"]["views"]["ghost"].metrics["w"].kl > 0  # a real comparison: views differ from dense
    for mode in ("cpu", "disk"):
        for key in ("plan", "stats", "operators", "mlp_maps", "views", "analysis"):
            assert same(runs["none"][key], runs[mode][key]), (mode, key)


def test_the_repair_criterion_and_streamline_choose_the_same_plans(tmp_path_factory):
    folder = saved_model(tmp_path_factory, "qwen2")
    selection = random_batches(2, seed=5)
    for plan in (
        PlanConfig(criterion="repair", num_layers=2, repair_method="ghost", criterion_samples=2),
        PlanConfig(criterion="repair_greedy", num_layers=2, repair_method="rot", criterion_samples=2),
        PlanConfig(criterion="streamline", num_layers=2),
    ):
        runs = {mode: run_phases(folder, mode, plan, selection) for mode in ("none", "disk")}
        assert runs["none"]["plan"]["scores"], plan.criterion  # the candidates were scored
        for key in ("plan", "operators", "views"):
            assert same(runs["none"][key], runs["disk"][key]), (plan.criterion, key)


def test_one_block_on_the_device_at_a_time_each_loaded_once_per_pass(tmp_path_factory, monkeypatch):
    from accelerate.hooks import AlignDevicesHook

    folder = saved_model(tmp_path_factory)
    for mode in ("cpu", "disk"):
        model = load(folder, mode)
        blocks = list(decoder_stack(model).layers)
        assert not any(materialised(b) for b in blocks) and model_device(model) == torch.device("cpu")
        on_device: list[tuple[bool, int]] = []

        def count(module, args, kwargs, blocks=blocks, on_device=on_device):
            # Whether this block holds its weights as it is called, and how many blocks do.
            on_device.append((materialised(module), sum(materialised(b) for b in blocks)))

        for block in blocks:
            block.register_forward_pre_hook(count, with_kwargs=True)
        loads: dict[int, int] = {}
        onload = AlignDevicesHook._onload_weights

        def counted(hook, module, loads=loads, onload=onload):
            loads[id(module)] = loads.get(id(module), 0) + 1
            return onload(hook, module)

        monkeypatch.setattr(AlignDevicesHook, "_onload_weights", counted)
        cal = calibrate(model, PLAN, RECOVERY[:1], random_batches(4), log=lambda m: None)
        q_proj = [id(b.self_attn.q_proj) for b in blocks]
        # One pass of statistics to the input of block 5 (the second gap's end) and one student pass at the
        # second gap (dense to block 5, the student through blocks 0 and 2 on the way): blocks 0-4 twice,
        # block 5 never, whatever the number of batches.
        assert [loads.get(q, 0) for q in q_proj] == [2, 2, 2, 2, 2, 0], mode
        loads.clear()
        evaluate(cal.pruned, cal.pruned.views, {"w": torch.randint(0, 512, (6, 32))}, 2)
        # Dense, pruned and ghost advance together: each block once, the head once.
        assert [loads.get(q, 0) for q in q_proj] == [1] * 6, mode
        assert loads[id(model.lm_head)] == 1
        assert max(total for _, total in on_device) == 1, mode
        assert {total for own, total in on_device if own} == {1}, mode  # a block runs alone on the device
        monkeypatch.undo()


def test_exports_are_the_same_files(tmp_path_factory, tmp_path, tiny_tokenizer):
    """Hugging Face folders (one shard per block under offload) hold the in-memory export's tensors and config;
    GGUF files are the same bytes; an exported folder loads and computes as the in-memory one. A tied model's
    folded view unties its head as in memory."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ghostdistill.export import export_view
    from ghostdistill.export.gguf import export_gguf

    methods = {"ghost": "ghost", "rot": "rotation_anchored", "rm": "replaceme", "pruned": None}
    for tied in (False, True):
        folder = saved_model(tmp_path_factory, "llama", tied=tied)
        for mode in MODES:
            pruned = run_phases(folder, mode)["cal"].pruned
            root = tmp_path / f"{tied}" / mode
            for view, method in methods.items():
                export_view(pruned, view, root / view, method=method, tokenizer=tiny_tokenizer)
            export_gguf(pruned, "rot", root, method="rotation_anchored", tokenizer=tiny_tokenizer, types=["Q8_0"])
            export_gguf(pruned, "pruned", root, method=None, tokenizer=tiny_tokenizer, types=["F32"])
        for mode in ("cpu", "disk"):
            for view in methods:
                a, b = tmp_path / f"{tied}" / "none" / view, tmp_path / f"{tied}" / mode / view
                tensors = [
                    {k: v for f in sorted(x.glob("*.safetensors")) for k, v in load_file(f).items()} for x in (a, b)
                ]
                assert same(*tensors), (tied, mode, view)
                assert (a / "config.json").read_text() == (b / "config.json").read_text(), (tied, mode, view)
            for name in ("rot.Q8_0.gguf", "pruned.F32.gguf"):
                assert (tmp_path / f"{tied}" / "none" / name).read_bytes() == (
                    tmp_path / f"{tied}" / mode / name
                ).read_bytes()
        ids = torch.randint(0, 512, (2, 16))
        logits = [
            AutoModelForCausalLM.from_pretrained(tmp_path / f"{tied}" / mode / "rot")(ids).logits
            for mode in ("none", "disk")
        ]
        assert torch.equal(*logits)


def test_distillation_and_several_devices_are_refused_in_one_line(tmp_path_factory):
    import pytest

    from ghostdistill.distill.config import DistillConfig
    from ghostdistill.pipeline.calibrate import Dist
    from ghostdistill.pipeline.train import build_students

    folder = saved_model(tmp_path_factory)
    model = load(folder, "disk")
    cal = calibrate(model, PLAN, RECOVERY[:1], random_batches(2), log=lambda m: None)
    with pytest.raises(ValueError, match=r"^model.model.offload disk .*FSDP2.*docs/distillation.md") as err:
        build_students(cal.pruned, DistillConfig(methods=["ghost"]))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="FSDP2"):
        calibrate(model, PLAN, RECOVERY[:1], random_batches(2), log=lambda m: None, dist=Dist(0, 2, lambda t: t))
    with pytest.raises(ValueError, match=r"offload 'gpu' is not one of \['none', 'cpu', 'disk'\]"):
        ModelConfig(offload="gpu")


def test_fit_with_the_weights_on_the_disk_writes_the_same_results(tiny_dir, text_files, tmp_path):
    """`fit` through the CLI (Lightning's test loop scoring every batch in one block-by-block pass at its end, the
    analysis, the export callback): results.json's views and the exported tensors are those of `offload: none`;
    asking it to distil is refused before anything loads."""
    import json

    import pytest
    from safetensors.torch import load_file
    from tiny_run import tiny_run_args

    from ghostdistill.cli import main

    recovery = [{"name": "ghost"}, {"name": "rot", "method": "rotation_anchored"}]
    results = {}
    for mode in ("none", "disk"):
        run = tmp_path / mode
        extra = ["--model.model.offload", mode, "--export.views", "[ghost, rot]", "--data.evaluation.max_windows", "4"]
        main(tiny_run_args(tiny_dir, text_files, run, *extra, layers=(1, 3, 4), recovery=recovery, batch_size=2))
        report = json.loads((run / "results.json").read_text())
        # Every tensor of every shard: offloaded, the export writes a shard per block as it goes.
        tensors = {
            v: {k: t for f in sorted((run / "export" / v).glob("*.safetensors")) for k, t in load_file(f).items()}
            for v in ("ghost", "rot")
        }
        results[mode] = (report["views"], report["analysis"], tensors)
    assert same(results["none"][0], results["disk"][0]) and same(results["none"][1], results["disk"][1])
    for view in ("ghost", "rot"):  # rot's embedding folded by its rotations
        assert same(results["none"][2][view], results["disk"][2][view]), view
    with pytest.raises(ValueError, match="FSDP2"):
        main(tiny_run_args(tiny_dir, text_files, tmp_path / "distil", "--model.model.offload", "disk",
                           "--trainer.max_steps", "2", "--model.distill.methods", "[ghost]"))  # fmt: skip


def test_params_count_a_tied_embedding_once_whatever_the_offload(tmp_path_factory):
    """Issue 53: offloaded, accelerate gives the head and the embedding of a tied model a placeholder each after
    the first pass, and the params column counted the embedding twice (SmolLM2 with offload disk: 162.8M
    against 134.5M)."""
    folder = saved_model(tmp_path_factory, tied=True)
    windows = {"w": torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))}
    counts = {}
    for mode in MODES:
        cal = calibrate(load(folder, mode), PLAN, RECOVERY[:2], random_batches(2), log=lambda m: None)
        views = evaluate(cal.pruned, cal.pruned.views, windows, 2, methods=METHODS)  # passes: the heads untied
        counts[mode] = {view: result.params for view, result in views.items()}
    dense = sum(p.numel() for p in load(folder, "none").parameters())
    assert counts["none"]["dense"] == dense, counts
    assert counts["cpu"] == counts["none"] and counts["disk"] == counts["none"], counts


def test_offload_with_fsdp2_on_one_device_is_refused_before_the_model_loads(
    tiny_dir, text_files, tmp_path, monkeypatch
):
    """Issue 53: docs/gpu.md says offload with FSDP2 is refused; on one device it ran (the mesh check sat in the
    sharded load, which the offloaded load went around)."""
    import json

    import pytest
    from tiny_run import tiny_run_args

    from ghostdistill.cli import main
    from ghostdistill.pipeline import run as run_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_module, "load_model", never)
    fsdp2 = {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1, "save_distributed_checkpoint": False},
    }
    args = ["--model.model.offload", "disk", "--trainer.strategy", json.dumps(fsdp2), "--trainer.accelerator", "cpu"]
    with pytest.raises(ValueError) as err:
        main(tiny_run_args(tiny_dir, text_files, tmp_path / "run", *args))
    assert str(err.value) == (
        "model.model.offload 'disk' with FSDP2 (trainer.strategy ModelParallelStrategy): the blocks are sharded over "
        "the ranks instead; set model.model.offload: none, or run without FSDP2"
    )


def test_an_interrupted_offloaded_calibration_says_what_a_rerun_finds_and_keeps_the_plan(tmp_path_factory, monkeypatch):
    """Issue 53: SIGTERM in the block-by-block statistics pass said "rerun to resume" with nothing saved. The plan is
    saved before the pass (no batch done), the stop says that the statistics are collected again, and the rerun
    resumes from the saved plan to the uninterrupted run's operators, bit for bit."""
    import pytest

    from ghostdistill.calibration.state import load_state
    from ghostdistill.pipeline import calibrate as calibrate_module

    folder, batches = saved_model(tmp_path_factory), random_batches(4)
    state = tmp_path_factory.mktemp("state") / "calibration_state.pt"
    plan = PlanConfig(criterion="streamline", num_layers=2)
    whole = calibrate(load(folder, "disk"), plan, RECOVERY[:1], batches, log=lambda m: None)
    real = calibrate_module.accumulate

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate_module, "accumulate", stopped)
    said = []
    with pytest.raises(KeyboardInterrupt):
        calibrate(load(folder, "disk"), plan, RECOVERY[:1], batches, log=said.append, state_path=state, state_key="k")
    assert said[-1] == (
        "calibration stopped: with model.model.offload the statistics are collected block by block over every batch "
        f"and are complete only at the end of the pass, so none of them was saved; the plan is saved in {state}, and "
        "a rerun collects them again from the first block"
    )
    saved = load_state(state, "k", {"ghost"}, 64, recovery=RECOVERY[:1])
    assert saved is not None and saved.batches_done == 0 and saved.plan.removed == whole.plan.removed
    monkeypatch.setattr(calibrate_module, "accumulate", real)
    said.clear()
    again = calibrate(load(folder, "disk"), plan, RECOVERY[:1], batches, log=said.append, saved=saved, state_path=state)
    assert f"resuming calibration after 0/4 batches from {state}" in said
    assert same(again.pruned.operators["ghost"].state_dict(), whole.pruned.operators["ghost"].state_dict())
