"""compressed-tensors folders for vLLM (`export.compressed`): a tiny LLaMA's plain and operator views quantized by
llm-compressor's `oneshot` in its own environment, read back by transformers there (the quantization config,
the packed int4 / int8 weights, logits near the float view's); and the refusals made before any work.

The quantizing tests need llm-compressor's environment (`bash scripts/setup.sh --quantize` makes
`.venv-quantize`; or name its Python in GHOSTDISTILL_QUANTIZE_PYTHON) and are skipped, with the reason, where
it is absent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fit_all, random_batches, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import compressed
from ghostdistill.export.formats import check_formats
from ghostdistill.export.pieces import exporting
from ghostdistill.export.writer import prepare
from ghostdistill.methods import RecoveryConfig

ROOT = Path(__file__).resolve().parents[2]
METHODS = [RecoveryConfig(name="ghost"), RecoveryConfig(name="rot", method="rotation_through")]
METHOD_OF = {"ghost": "ghost", "rot": "rotation_through", "pruned": None}


def _quantize_python() -> Path | None:
    try:
        return compressed.quantize_python()
    except FileNotFoundError:
        return None


def test_bad_schemes_and_formats_are_one_line_errors():
    with pytest.raises(ValueError, match=r"scheme \['W3A16'\] is not one of \['W8A8', 'W4A16'"):
        compressed.check_schemes(["W4A16", "W3A16"])
    with pytest.raises(ValueError, match="is not one of"):
        compressed.check_schemes([])
    assert check_formats(["hf", "compressed-tensors"]) == ["hf", "compressed-tensors"]
    assert compressed.targets("out", ["a", "b"], ["W8A8", "W4A16"]) == [
        Path("out/a.W8A8"), Path("out/a.W4A16"), Path("out/b.W8A8"), Path("out/b.W4A16"),
    ]  # fmt: skip


def test_a_missing_environment_is_refused_with_the_command_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv(compressed.PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(FileNotFoundError, match=r"cannot import llmcompressor: run `bash scripts/setup.sh --quantize`"):
        compressed.quantize_python()
    # An interpreter that exists but has no llm-compressor (this one, as setup.sh makes it) is refused too.
    if importlib.util.find_spec("llmcompressor") is None:
        with pytest.raises(FileNotFoundError, match="cannot import llmcompressor"):
            compressed.quantize_python(sys.executable)


def test_export_refuses_a_compressed_export_before_the_run_loads(tmp_path):
    """`export <run> --format compressed-tensors` without llm-compressor's environment: exit 2, one line, before
    the run folder is even read (it does not exist here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), compressed.PYTHON_ENV: str(tmp_path / "none")}
    command = [sys.executable, "-m", "ghostdistill", "export", str(tmp_path / "run"), "--views", "rot"]
    bad = subprocess.run(
        [*command, "--format", "compressed-tensors", "--schemes", "W3"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "scheme ['W3'] is not one of" in bad.stderr, bad.stderr
    missing = subprocess.run([*command, "--format", "compressed-tensors"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2, missing.stderr
    assert "cannot import llmcompressor: run `bash scripts/setup.sh --quantize`" in missing.stderr, missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr


@pytest.fixture(scope="module")
def fitted():
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama", 6), PruningPlan.from_layers([2, 3], 6), METHODS)
    return pm


READ_BACK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
folder, ids, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
with torch.no_grad():
    logits = model(torch.load(ids)).logits
torch.save(logits, out)
"""


@pytest.mark.parametrize("view", ["rot", "ghost"])
def test_views_quantize_and_read_back_near_the_float_view(fitted, view, tmp_path, tiny_tokenizer):
    python = _quantize_python()
    if python is None:
        pytest.skip(f"llm-compressor's environment is missing: `{compressed.SETUP}` makes .venv-quantize")
    calibration = torch.cat([b["input_ids"] for b in random_batches(n=4, batch=4, seq=32)])
    with exporting(fitted, view):
        prepared = prepare(fitted, view, METHOD_OF[view], tiny_tokenizer, {"seed": 0}, calibration=lambda: calibration)
        paths = compressed.write_compressed(prepared, tmp_path, ["W8A8", "W4A16"], python, log=lambda _: None)
    assert paths == [tmp_path / f"{view}.W8A8", tmp_path / f"{view}.W4A16"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no work folder left
    ids = calibration[:2]
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad(), fitted.use(view) as model:
        reference = model(ids).logits
    for path, bits in zip(paths, (8, 4)):
        config = json.loads((path / "config.json").read_text())
        quant = config["quantization_config"]
        assert quant["quant_method"] == "compressed-tensors"
        weights = [g["weights"] for g in quant["config_groups"].values()]
        assert [w["num_bits"] for w in weights] == [bits]
        # The head stays in float, ignored by its full name (`pruned.lm_head` in an operator folder).
        assert [n for n in quant["ignore"] if n.split(".")[-1] == "lm_head"], quant["ignore"]
        assert config["ghostdistill"]["quantization"]["scheme"] == path.name.split(".")[1]
        assert config["ghostdistill"]["plan"]["removed"] == [2, 3]
        assert (path / "modeling_ghostdistill.py").is_file() == (view == "ghost")
        subprocess.run(
            [str(python), "-c", READ_BACK, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
            check=True, env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path,
        )  # fmt: skip
        logits = torch.load(tmp_path / "logits.pt")
        # A quantized model is near its float view, not equal: the relative error of the logits stays small,
        # and a float model with its weights left random would be far (error ~ 1).
        error = ((logits - reference).norm() / reference.norm()).item()
        assert 0 < error < (0.05 if bits == 8 else 0.25), (path.name, error)
