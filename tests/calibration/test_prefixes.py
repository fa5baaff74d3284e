"""Calibration-size prefixes from one pass equal separate passes over the first n windows."""

import os
import subprocess

import pytest
import torch
from conftest import tiny_model

from ghostdistill.calibration.prefixes import accumulate_prefixes, prefix_batches
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.model import decoder_stack
from ghostdistill.core.plan import PruningPlan
from ghostdistill.methods import make_collectors


def test_prefix_batches_cut_at_every_size():
    assert prefix_batches(10, [3, 8], 4) == [(0, 3), (3, 7), (7, 8), (8, 10)]
    assert prefix_batches(8, [8], 8) == [(0, 8)]
    with pytest.raises(ValueError, match=r"\[12\]"):
        prefix_batches(10, [4, 12], 4)


@torch.no_grad()
def test_prefixes_equal_separate_passes():
    model = tiny_model("llama", num_layers=6)
    plan = PruningPlan.from_layers([1, 2, 4], 6)
    stack = decoder_stack(model)
    windows = torch.randint(0, 512, (10, 24), generator=torch.Generator().manual_seed(5))
    methods = {"ghost", "linearpatch", "replaceme"}
    got = dict(
        accumulate_prefixes(
            model,
            stack,
            plan.gaps,
            windows,
            [2, 7, 10],
            methods,
            64,
            "cpu",
            batch_size=3,
        )
    )
    assert list(got) == [2, 7, 10]
    for n, stats in got.items():
        separate = {g.key: make_collectors(methods, 64, "cpu") for g in plan.gaps}
        accumulate(model, stack, plan.gaps, [{"input_ids": windows[:n]}], separate)
        for key, collectors in separate.items():
            for name, c in collectors.items():
                _assert_same(stats[key][name].state_dict(), c.state_dict())


def _assert_same(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    else:
        assert a == b


def test_sensitivity_script_writes_every_source_and_size(tiny_dir, text_files, tmp_path):
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "sens"
    cmd = [
        sys.executable,
        str(root / "scripts" / "studies" / "calibration_sensitivity.py"),
        "--model",
        str(tiny_dir),
        "--layers",
        "2-3",
        "--sizes",
        "2,4",
        "--seq-len",
        "32",
        "--eval-windows",
        "2",
        "--wikitext-skip",
        "4",
        "--sources",
        "c4,wikitext,mix,generate",
        "--eval-c4-windows",
        "1",
        "--c4-split",
        "150",
        "--c4",
        str(text_files["jsonl_gz"]),
        "--wikitext",
        str(text_files["txt"]),
        "--out",
        str(out),
    ]
    run = _run(cmd, root)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "sensitivity.json").read_text())
    assert list(result["curves"]) == ["c4", "wikitext", "mix", "generate"]
    assert result["dense_c4"] > 1 and all("ppl_c4" in r for rows in result["curves"].values() for r in rows)
    for rows in result["curves"].values():
        assert [r["windows"] for r in rows] == [2, 4]
        assert all(r["ppl"] > 1 for r in rows)
    assert result["pruned"] != result["dense"]
    assert (out / "sensitivity.png").stat().st_size > 1000
    assert "| c4 |" in (out / "sensitivity.md").read_text()

    # Appending a source from saved windows of another length: counted in tokens, the rest kept.
    import torch as _torch

    short = _torch.load(out / "generated_4x32_seed0.pt")[:, :16].clone()
    _torch.save(short, tmp_path / "short.pt")
    cmd = [a for a in cmd if a not in ("c4,wikitext,mix,generate",)]
    cmd[cmd.index("--sources") + 1 : cmd.index("--sources") + 1] = ["generate"]
    cmd += [
        "--append",
        "--generated",
        str(tmp_path / "short.pt"),
        "--eval-c4-windows",
        "0",
    ]
    cmd[cmd.index("--sizes") + 1] = "4"
    run = _run(cmd, root)
    assert run.returncode == 0, run.stderr[-2000:]
    again = json.loads((out / "sensitivity.json").read_text())
    assert again["curves"]["c4"] == result["curves"]["c4"] and again["dense"] == result["dense"]
    assert again["curves"]["generate"] == [{"windows": 4, "tokens": 64, "ppl": again["curves"]["generate"][0]["ppl"]}]
    assert again["curves"]["generate"][0]["ppl"] != result["curves"]["generate"][1]["ppl"]


def _run(cmd: list[str], root) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=root, check=False, env=env)
