"""FSDP2 in every phase: two CPU processes (gloo) whose model is sharded as it loads (`core.sharded`) choose the
plan one process chooses (a repair-aware criterion), collect its statistics, solve its operators (a sequential
fit included), score its perplexities, zero-shot accuracies and analyses and export a folded view (Hugging Face
and GGUF), within float64 round-off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_run import tiny_run_args

from ghostdistill.cli import main

ROOT = Path(__file__).resolve().parents[2]

FSDP2 = json.dumps(
    {
        "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": False},
    }
)
RECOVERY = [
    {"name": "ghost", "method": "ghost", "order": "sequential"},
    {"name": "ra", "method": "rotation_anchored"},
]


def _args(tiny_dir, text_files, run, piqa_dir, *extra):
    selection = {"source": str(text_files["jsonl_gz"]), "first_document": 150}
    # lm-eval on every rank alike (each forward is collective), rank 0's scores broadcast to all.
    zeroshot = {"enabled": True, "tasks": ["piqa"], "data_dir": str(piqa_dir), "limit": 6, "batch_size": 4}
    return tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--model.plan.criterion",
        "repair_greedy",
        "--data.calibration.source.max_documents",
        "150",
        "--data.selection.source",
        json.dumps(selection),
        "--data.selection.num_windows",
        "3",
        "--data.selection.seq_len",
        "32",
        "--export.views",
        "[ra]",  # the operator views' export under FSDP2: tests/distill/test_distillation.py (ghost_lora_ft)
        "--export.format",
        "[hf, gguf]",
        "--export.gguf_types",
        "[F32]",
        "--trainer.accelerator",
        "cpu",
        "--model.evaluation.zeroshot",
        json.dumps(zeroshot),
        *extra,
        layers=None,
        num_layers=2,
        recovery=RECOVERY,
        samples=10,  # 3 batches of 4, 4 and 2 windows: one rank runs a padding batch that is not counted
        eval_windows=5,
    )


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _two_gap_model(tiny_dir: Path, folder: Path) -> Path:
    """The tiny LLaMA with blocks 1 and 3 near-identity (their residual updates, o_proj and down_proj, scaled by
    NEAR): whatever the random weights, the greedy criterion removes those two separate blocks (two gaps), and
    the operator of the first is not the identity, so the second gap's sequential fit reads a student that
    differs from the teacher."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, folder)
    weights = load_file(folder / "model.safetensors")
    for block in (1, 3):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weights[f"model.layers.{block}.{name}.weight"] *= NEAR
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


NEAR = 0.1


def _piqa_folder(root: Path) -> Path:
    """Six PIQA-shaped items written here (the layout of ../shared/data/piqa), so that the test runs on a clone
    with nothing beside it."""
    items = [
        {"goal": f"How do I fix thing {i}?", "sol1": f"Use tool {i} with care.", "sol2": f"Throw thing {i} away."}
        for i in range(6)
    ]
    (root / "piqa").mkdir(parents=True)
    (root / "piqa" / "valid.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    (root / "piqa" / "valid-labels.lst").write_text("".join(f"{i % 2}\n" for i in range(6)))
    return root


@pytest.mark.slow  # one process in this one, two started (gloo)
def test_two_sharded_processes_give_the_results_of_one(tiny_dir, text_files, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    piqa = _piqa_folder(tmp_path / "data")
    tiny_dir = _two_gap_model(tiny_dir, tmp_path / "model")
    main(_args(tiny_dir, text_files, one, piqa))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    extra = ("--trainer.devices", "2", "--trainer.strategy", FSDP2)
    out = subprocess.run(
        [sys.executable, "-m", "ghostdistill", *_args(tiny_dir, text_files, two, piqa, *extra)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "blocks sharded over 2 ranks as it loads" in out.stderr + out.stdout
    r1, r2 = (json.loads((run / "results.json").read_text()) for run in (one, two))
    # The plan: the same blocks, every candidate's KL.
    assert r2["plan"]["removed"] == r1["plan"]["removed"]
    assert r1["plan"]["removed"] == [1, 3], "two gaps: the sequential fit of the second reads the student"
    for step, row in r1["plan"]["candidates"].items():
        for block, kl in row["tried"].items():
            assert r2["plan"]["candidates"][step]["tried"][block] == pytest.approx(kl, rel=1e-6), (step, block)
    # The statistics: float64 sums over both ranks' windows (one padding batch not counted).
    s1, s2 = (torch.load(run / "calibration_state.pt", weights_only=False) for run in (one, two))
    assert s1["tokens"] == s2["tokens"] == 10 * 32
    for gap, collectors in s1["stats"].items():
        for group, value in collectors["ghost"]["xtx"].items():
            torch.testing.assert_close(s2["stats"][gap]["ghost"]["xtx"][group], value, rtol=1e-12, atol=1e-9)
    # Every view's perplexity, KL and top-1 on 5 windows (one rank runs a padding window).
    for view in ("dense", "pruned", "ghost", "ra"):
        m1, m2 = (r["views"][view]["metrics"]["held_out"] for r in (r1, r2))
        assert m2["tokens"] == m1["tokens"] == 5 * 31, view
        assert m2["ppl"] == pytest.approx(m1["ppl"], rel=1e-6), view
        if view != "dense":
            assert m2["kl"] == pytest.approx(m1["kl"], rel=1e-5, abs=1e-9), view
        assert r2["views"][view]["params"] == r1["views"][view]["params"], view
    # Zero-shot accuracy of every view: the same items, the same answers.
    for view in ("dense", "pruned", "ghost", "ra"):
        z1, z2 = (r["views"][view]["zeroshot"]["piqa"] for r in (r1, r2))
        assert z1["n"] == z2["n"] == 6, view
        assert z2["acc"] == z1["acc"] and z2["acc_norm"] == z1["acc_norm"], view
    # The analyses (every rank runs them alike; rank 0 reports).
    assert r1["analysis"]["gaps"]
    _close(r2["analysis"], r1["analysis"], "analysis")
    # The folded view's exports (its blocks rotated), gathered block by block.
    for view in ("ra",):
        t1, t2 = _tensors(one / "export" / view), _tensors(two / "export" / view)
        assert t1.keys() == t2.keys(), view
        for name, tensor in t1.items():
            torch.testing.assert_close(t2[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{view} {name}")
    import gguf

    g1, g2 = (
        {t.name: t.data for t in gguf.GGUFReader(str(run / "export" / "ra.F32.gguf")).tensors} for run in (one, two)
    )
    assert g1.keys() == g2.keys() and any(name.startswith("blk.") for name in g1)
    for name, data in g1.items():
        np.testing.assert_allclose(g2[name], data, rtol=1e-5, atol=1e-6, err_msg=name)


def _close(got, expected, where: str) -> None:
    """`got` equals `expected` (nested JSON) with floats within 1e-5 relative."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            _close(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _close(a, b, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-9), where
    else:
        assert got == expected, where


def test_every_shipped_fsdp2_config_shards_over_every_process():
    """`--print_config` does not reach the strategy check (tests/test_cli.py parses every config); here each
    shipped config's strategy passes it, and the 70B config removes the share of blocks the 8B one does."""
    import yaml
    from shipped_configs import SHIPPED

    from ghostdistill.cli import check_strategy_config

    configs = {p.name: yaml.safe_load(p.read_text()) for p in SHIPPED}
    fsdp2 = [name for name, c in configs.items() if "ModelParallel" in str((c.get("trainer") or {}).get("strategy"))]
    assert "llama3_70b.yaml" in fsdp2
    for name in fsdp2:
        check_strategy_config(configs[name]["trainer"]["strategy"])
        assert (
            configs[name]["trainer"]["strategy"]["init_args"]["data_parallel_size"]
            == configs[name]["trainer"]["devices"]
        )
    small, large = configs["llama3_11.yaml"]["model"]["plan"], configs["llama3_70b.yaml"]["model"]["plan"]
    assert (small["num_layers"], large["num_layers"]) == (11, 27) and 80 * 11 // 32 == 27
