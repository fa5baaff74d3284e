"""llama.cpp serves ghostdistill's GGUF files (SmolLM2-135M at 7 removed blocks): the pruned view and a folded
ones (rotation_through, rotation_anchored) as F32, F16 and Q8_0, greedy token ids as transformers' (F32), `llama-perplexity` on the
run's windows within 1% (F32, F16) / 3% (Q8_0) of transformers' figure on the same tokens, llama.cpp's
tokenisation equal to the run's windows, llama.cpp's own convert_hf_to_gguf.py writing the same tensors; the
operator view (ghost) refused.

Opt-in: it needs llama.cpp's tools (`bash scripts/serving/llama_cpp.sh`, or `bash scripts/setup.sh --serve`,
builds them into .serve/llama.cpp; GHOSTDISTILL_LLAMA_CPP names another build) and is skipped, with the reason,
where they are absent. About 4 minutes on 2 CPU cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import serving_run

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("GHOSTDISTILL_LLAMA_CPP", ROOT / ".serve" / "llama.cpp"))
TOOLS = ("llama-greedy-ids", "llama-perplexity", "llama-tokenize")


def _missing() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    missing = [t for t in TOOLS if not (LLAMA_CPP / "bin" / t).is_file()]
    if missing:
        return f"{LLAMA_CPP}: {missing} not built; `bash scripts/serving/llama_cpp.sh` builds them"
    return None


@pytest.mark.slow
@pytest.mark.serving
def test_llama_cpp_serves_plain_and_folded_gguf_token_for_token(tmp_path):
    why = _missing()
    if why:
        pytest.skip(why)
    run = serving_run(tmp_path)
    out = tmp_path / "llama_cpp.json"
    check = [
        sys.executable, str(ROOT / "scripts" / "serving" / "check_llama_cpp.py"), str(run), "--views", "pruned",
        "rotation_through", "rotation_anchored", "ghost", "--dir", str(tmp_path / "gguf"), "--llama-cpp", str(LLAMA_CPP), "--new", "12",
        "--parity", "--discard", "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, env=env, check=False)  # this checkout's
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "rotation_through" in report["views"]["ghost"]["refused"]
    for view in ("pruned", "rotation_through", "rotation_anchored"):
        entry = report["views"][view]
        assert entry["same_windows"], view
        assert entry["F32"]["same_tokens"], (view, entry["F32"]["tokens"], entry["transformers"]["tokens"])
        for gguf_type in ("F32", "F16", "Q8_0"):
            assert entry[gguf_type]["within_tolerance"], (view, gguf_type, entry[gguf_type]["rel_diff"])
        parity = entry["converter_parity"]
        assert parity["same_tensors"] and not parity["metadata_differing"], (view, parity)
    # --discard kept one view's files on disk at a time (CI's disk ran out with all of them) and left none behind
    assert not list((tmp_path / "gguf").rglob("*.gguf")), sorted((tmp_path / "gguf").rglob("*"))
    assert not list((tmp_path / "gguf").rglob("*.safetensors")), sorted((tmp_path / "gguf").rglob("*"))
