"""vLLM serves what ghostdistill exports, token for token (SmolLM2-135M at 7 removed blocks): a plain folder
(pruned) through vLLM's own model, a folded one (rotation_through) likewise, and a folder with operators (ghost)
through vLLM's Transformers backend and the folder's `modeling_ghostdistill.py`.

Opt-in: it needs the serving environment (`bash scripts/setup.sh --serve` makes `.venv-serve`, ghostdistill and
vLLM in one environment; or name its python in GHOSTDISTILL_VLLM_PYTHON) and is skipped, with the reason, where
it is absent. About 3 minutes on 2 CPU cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import C4_HEAD, WIKITEXT_HEAD

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("GHOSTDISTILL_VLLM_PYTHON", ROOT / ".venv-serve" / "bin" / "python"))


def _has_vllm() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON} does not exist: `bash scripts/setup.sh --serve` makes the serving environment"
    done = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"vllm does not import under {VLLM_PYTHON}: {done.stderr[-300:]}"


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serves_plain_folded_and_operator_exports_token_for_token(tmp_path):
    why = _has_vllm()
    if why:
        pytest.skip(why)
    run = tmp_path / "run"
    fit = [
        sys.executable, "-m", "ghostdistill", "fit", "--config", str(ROOT / "configs" / "smollm2_demo.yaml"),
        "--model.plan.layers", "[12,13,14,15,16,17,18]", "--model.plan.num_layers", "null",
        "--model.recovery", "[{name: ghost, method: ghost}, {name: rotation_through, method: rotation_through}]",
        "--model.evaluation.analysis", "false",
        "--data.calibration.source.source", str(C4_HEAD), "--data.calibration.num_samples", "8",
        "--data.evaluation.sources", f"[{{name: wikitext2, source: {WIKITEXT_HEAD}, join: ''}}]",
        "--data.evaluation.max_windows", "2",
        "--trainer.default_root_dir", str(run),
    ]  # fmt: skip
    done = subprocess.run(fit, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "serving.json"
    check = [
        sys.executable, str(ROOT / "scripts" / "check_serving.py"), str(run), "--views", "pruned", "ghost",
        "rotation_through", "--dir", str(tmp_path / "served"), "--stacks", "transformers", "vllm",
        "--vllm-python", str(VLLM_PYTHON), "--new", "12", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["views"]["ghost"]["kind"] == "operators"
    assert report["views"]["rotation_through"]["kind"] == report["views"]["pruned"]["kind"] == "plain"
    for view, r in report["views"].items():
        assert r["transformers"]["same_tokens_as_run"], f"{view}: the exported folder's tokens differ from the run's"
        assert abs(r["transformers"]["ppl"] - r["ppl_run"]) / r["ppl_run"] < 1e-4, view
        assert r["vllm"]["same_tokens"], f"{view}: vLLM's greedy tokens differ from transformers'"
        assert r["vllm"]["within_tolerance"], (
            f"{view}: vLLM's perplexity {r['vllm']['ppl']} vs {r['transformers']['ppl']}"
        )
