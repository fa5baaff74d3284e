"""SmolLM2-135M with 7 blocks removed (12–18) and ghost operators: the exported folder reloads in a fresh
process without ghostdistill, greedily generates the in-memory view's tokens (batched, left-padded, KV
cache) and gives its perplexity."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import C4_HEAD, WIKITEXT_HEAD

from ghostdistill.calibration.fit import fit_methods
from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.data import TextSource, calibration_windows, evaluation_windows
from ghostdistill.evaluation.metrics import next_token_nll
from ghostdistill.export import export_view
from ghostdistill.methods import RecoveryConfig, make_collectors

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "Water boils at",
]


@pytest.mark.slow
def test_exported_ghost_reloads_generates_and_scores_like_the_view(smollm2, tmp_path):
    model, tok = smollm2
    plan = PruningPlan.from_layers(list(range(12, 19)), 30)
    pm = PrunedModel(model, plan)
    side = tok.padding_side
    try:
        cal = calibration_windows(tok, TextSource(str(C4_HEAD)), 256, 16, seed=0)
        batches = [{"input_ids": cal[i : i + 8]} for i in range(0, 16, 8)]
        stats = {g.key: make_collectors({"ghost"}, 576, "cpu") for g in plan.gaps}
        accumulate(model, pm.stack, plan.gaps, batches, stats)
        fit_methods([RecoveryConfig(name="ghost")], pm, stats, batches, 576, "cpu")
        assert pm.operators["ghost"]["12-18"].separate_first
        folder = export_view(pm, "ghost", tmp_path / "ghost", method="ghost", tokenizer=tok)

        tok.padding_side = "left"
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        assert (enc["attention_mask"] == 0).any(), "the prompts must really be padded"
        windows = evaluation_windows(tok, TextSource(str(WIKITEXT_HEAD), join=""), 256, max_windows=4)
        with torch.no_grad(), pm.use("ghost") as view:
            expected = view.generate(**enc, max_new_tokens=16, do_sample=False)
            nll, count = 0.0, 0
            for chunk in windows.split(2):
                s, n = next_token_nll(view(input_ids=chunk).logits, chunk, torch.ones_like(chunk))
                nll, count = nll + float(s), count + n
        ppl = math.exp(nll / count)

        inputs = tmp_path / "inputs.pt"
        torch.save(
            {
                "ids": enc["input_ids"],
                "mask": enc["attention_mask"],
                "new": 16,
                "windows": windows,
                "batch_size": 2,
            },
            inputs,
        )
        env = {
            **os.environ,
            "PYTHONPATH": "",
            "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "OMP_NUM_THREADS": "1",
        }
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "reload_check.py"),
                str(folder),
                str(inputs),
                str(tmp_path / "out.pt"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = torch.load(tmp_path / "out.pt")
        assert out["class"].startswith("transformers_modules.") and out["class"].endswith("GhostPrunedForCausalLM")
        assert torch.equal(out["tokens"], expected), tok.batch_decode(out["tokens"])
        assert out["tokens_scored"] == count
        assert out["ppl"] == pytest.approx(ppl, rel=1e-5)
    finally:
        tok.padding_side = side
        pm.set_view("dense")
        pm.remove_hooks()
