"""Evaluation over several processes counts every window once: the shares are evened out with windows
that run but do not count (Lightning's DistributedSampler would count the first windows twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_args

from ghostdistill.lit.datamodule import EvenShares, _Windows

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("n, world", [(5, 2), (7, 3), (4, 2), (1, 2)])
def test_even_shares_count_each_window_once(n, world):
    windows = _Windows(torch.arange(n * 3).view(n, 3))
    shares = [list(EvenShares(windows, world, rank)) for rank in range(world)]
    assert len({len(s) for s in shares}) == 1, "every rank runs the same number of windows"
    counted = sorted(i for s in shares for i in s if windows[i]["counted"])
    assert counted == list(range(n)), "each real window is counted exactly once"
    for s in shares:
        for i in s:
            assert torch.equal(windows[i]["input_ids"], windows.ids[i % n])


@pytest.mark.slow  # two CLI runs, one of them two processes (gloo)
def test_two_processes_give_the_perplexity_of_one_with_an_uneven_window_count(tiny_dir, text_files, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    results = {}
    for devices in (1, 2):
        run = tmp_path / f"devices{devices}"
        args = tiny_run_args(
            tiny_dir,
            text_files,
            run,
            "--data.batch_size",
            "2",
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            str(devices),
            "--trainer.strategy",
            "ddp" if devices > 1 else "auto",
            samples=8,
            eval_windows=5,  # 5 windows over 2 ranks: one rank gets a padding copy
        )
        out = subprocess.run(
            [sys.executable, "-m", "ghostdistill", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=900,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        results[devices] = json.loads((run / "results.json").read_text())["views"]
    for view in ("dense", "pruned", "ghost"):
        one, two = (
            results[1][view]["metrics"]["held_out"],
            results[2][view]["metrics"]["held_out"],
        )
        assert two["tokens"] == one["tokens"] == 5 * 31, view
        assert two["ppl"] == pytest.approx(one["ppl"], rel=1e-5), view
        if view != "dense":
            assert two["kl"] == pytest.approx(one["kl"], rel=1e-4, abs=1e-7), view
