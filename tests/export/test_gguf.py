"""GGUF files of plain views on a tiny LLaMA: written, read back with `gguf.GGUFReader` (block count, tensor
shapes and types, no per-layer array of the dense length), loaded by transformers' own GGUF reader (which
undoes the Q/K permutation its own way) to the same logits; operator views refused; files atomic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import fit_all, tiny_model
from tiny_run import tiny_run_args

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export.formats import check_formats
from ghostdistill.export.gguf import (
    DEFAULT_GGUF_TYPES,
    check_gguf_types,
    export_gguf,
    gguf_path,
    read_gguf,
)
from ghostdistill.methods import RecoveryConfig

METHODS = [
    RecoveryConfig(name="ghost"),
    RecoveryConfig(name="lp", method="linearpatch", variant="diag"),
    RecoveryConfig(name="mag", method="magnitude"),
    RecoveryConfig(name="rm", method="replaceme"),
    RecoveryConfig(name="rot", method="rotation_through"),
]
METHOD_OF = {"ghost": "ghost", "lp": "linearpatch", "mag": "magnitude", "rm": "replaceme", "rot": "rotation_through"}
ROOT = Path(__file__).resolve().parents[2]
DENSE_BLOCKS = 6
REMOVED = [2, 3]


@pytest.fixture(scope="module")
def fitted():
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama", DENSE_BLOCKS), PruningPlan.from_layers(REMOVED, DENSE_BLOCKS), METHODS)
    return pm


@pytest.mark.parametrize("view", ["pruned", "mag", "rm", "rot"])
def test_plain_views_round_trip(fitted, view, tmp_path, tiny_tokenizer):
    paths = export_gguf(fitted, view, tmp_path, method=METHOD_OF.get(view), tokenizer=tiny_tokenizer)
    assert paths == [gguf_path(tmp_path, view, t) for t in DEFAULT_GGUF_TYPES]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)  # no temporary left
    kept = DENSE_BLOCKS - len(REMOVED)
    for path, gguf_type in zip(paths, DEFAULT_GGUF_TYPES):
        got = read_gguf(path)
        assert got["architecture"] == "llama" and got["block_count"] == kept
        assert got["fields"]["ghostdistill.dense_block_count"] == DENSE_BLOCKS
        assert got["fields"]["ghostdistill.removed_blocks"] == REMOVED
        assert got["fields"]["tokenizer.ggml.pre"] == "gpt-2"
        # llama.cpp #27976: no array may keep the dense model's per-layer length.
        assert DENSE_BLOCKS not in got["arrays"].values(), got["arrays"]
        tensors = got["tensors"]
        assert {int(n.split(".")[1]) for n in tensors if n.startswith("blk.")} == set(range(kept))
        assert tensors["blk.0.attn_q.weight"]["shape"] == [64, 64]
        assert tensors["blk.0.attn_k.weight"]["shape"] == [32, 64]  # 2 key-value heads of 16
        assert tensors["blk.3.ffn_down.weight"]["shape"] == [64, 128]
        assert tensors["token_embd.weight"]["shape"] == [512, 64]
        assert "output.weight" in tensors  # the tiny model's head is not tied
        assert tensors["blk.0.attn_norm.weight"]["type"] == "F32"
        assert tensors["blk.0.attn_q.weight"]["type"] == gguf_type


@torch.no_grad()
@pytest.mark.parametrize("view", ["pruned", "rot"])
def test_transformers_reads_the_f32_file_as_the_view(fitted, view, tmp_path, tiny_tokenizer):
    """transformers' GGUF loader maps the names back and undoes the Q/K permutation by its own code: the
    logits equal the view's, and the F16 file's nearly."""
    from transformers import AutoModelForCausalLM

    export_gguf(fitted, view, tmp_path, method=METHOD_OF.get(view), tokenizer=tiny_tokenizer, types=["F32", "F16"])
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with fitted.use(view) as model:
        expected = model(input_ids=ids).logits
    for gguf_type, tol in (("F32", 1e-4), ("F16", 5e-2)):
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=gguf_path(tmp_path, view, gguf_type).name, dtype=torch.float32
        ).eval()
        assert loaded.config.num_hidden_layers == DENSE_BLOCKS - len(REMOVED)
        got = loaded(input_ids=ids).logits
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_q8_0_blocks_dequantise_close(fitted, tmp_path, tiny_tokenizer):
    (path,) = export_gguf(fitted, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["Q8_0"])
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    got = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    with fitted.use("pruned") as model:
        expected = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    # Q8_0: per block of 32, error at most half a step of max|x|/127, plus the F16 rounding of the scale
    # (relative 2⁻¹¹, times up to 127 steps).
    amax = np.abs(expected.reshape(-1, 32)).max(axis=1, keepdims=True)
    assert (np.abs(got.reshape(-1, 32) - expected.reshape(-1, 32)) <= amax / 127 / 2 + amax * 2**-11).all()


@pytest.mark.parametrize("view", ["ghost", "lp"])
def test_operator_views_are_refused_with_the_alternatives(fitted, view, tmp_path, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"rotation_through.*vLLM") as err:
        export_gguf(fitted, view, tmp_path, method=METHOD_OF[view], tokenizer=tiny_tokenizer)
    assert "\n" not in str(err.value) and view in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_existing_files_are_kept_unless_overwrite(fitted, tmp_path, tiny_tokenizer):
    (path,) = export_gguf(fitted, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["F16"])
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        export_gguf(fitted, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["F32", "F16"])
    assert not gguf_path(tmp_path, "pruned", "F32").exists()
    export_gguf(fitted, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["F16"], overwrite=True)
    assert path.read_bytes() == before  # deterministic


def test_a_failed_write_leaves_nothing_behind(fitted, tmp_path, tiny_tokenizer, monkeypatch):
    def broken(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", broken)  # each tensor as it is made
    with pytest.raises(OSError, match="disk full"):
        export_gguf(fitted, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["F32"])
    assert list(tmp_path.iterdir()) == []


def test_format_and_type_names_are_checked():
    assert check_formats(["hf", "gguf"]) == ["hf", "gguf"]
    with pytest.raises(ValueError, match=r"\['onnx'\] is not one of \['hf', 'gguf'"):
        check_formats(["hf", "onnx"])
    # ghostdistill's own F32, F16, Q8_0, then llama-quantize's (export.quantize)
    with pytest.raises(ValueError, match=r"\['Q4'\] is not one of \['F32', 'F16', 'Q8_0', 'Q4_0', .*'Q4_K_M'"):
        check_gguf_types(["Q4"])
    assert check_gguf_types(["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"]) == ["Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GHOSTDISTILL_DEBUG": ""}
    return subprocess.run(
        [sys.executable, "-m", "ghostdistill", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    """The error: one line, the last (loading a run's config logs Lightning's device lines before it)."""
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert errors == [lines[-1]] and lines[-1].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


def test_a_bad_format_or_type_is_one_line_naming_the_valid_ones(tmp_path):
    line = _one_error_line(_cli("export", str(tmp_path), "--views", "pruned", "--format", "hf", "onnx"))
    assert "['onnx']" in line and "['hf', 'gguf', 'compressed-tensors']" in line
    line = _one_error_line(_cli("export", str(tmp_path), "--views", "pruned", "--format", "gguf", "--gguf-types", "Q4"))
    assert "['Q4']" in line and "['F32', 'F16', 'Q8_0', 'Q4_0'," in line and "'Q4_K_M'" in line


def test_fit_writes_gguf_and_export_refuses_operator_views_before_loading(tiny_dir, text_files, tmp_path):
    """`export.format: [hf, gguf]` at the end of `fit`; `export --format gguf` from the run folder writes the
    same file, and refuses an operator view in one line naming the alternatives."""
    from ghostdistill.cli import main

    run = tmp_path / "run"
    recovery = [{"name": "ghost"}, {"name": "rot", "method": "rotation_through"}]
    main(
        tiny_run_args(
            tiny_dir,
            text_files,
            run,
            "--model.evaluation.analysis",
            "false",
            "--export.views",
            "[pruned, rot]",
            "--export.format",
            "[hf, gguf]",
            "--export.gguf_types",
            "[F32, Q8_0]",
            recovery=recovery,
        )
    )
    root = run / "export"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["pruned", "pruned.F32.gguf", "pruned.Q8_0.gguf", "rot", "rot.F32.gguf", "rot.Q8_0.gguf"]
    assert read_gguf(root / "rot.F32.gguf")["block_count"] == 4
    out = tmp_path / "again"
    main(["export", str(run), "--views", "rot", "--dir", str(out), "--format", "gguf", "--gguf-types", "F32"])
    assert sorted(p.name for p in out.iterdir()) == ["rot.F32.gguf"]
    assert (out / "rot.F32.gguf").read_bytes() == (root / "rot.F32.gguf").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        main(["export", str(run), "--views", "rot", "--dir", str(out), "--format", "gguf", "--gguf-types", "F32"])
    line = _one_error_line(_cli("export", str(run), "--views", "rot", "ghost", "--format", "gguf"))
    assert "'ghost'" in line and "rotation_through" in line and "vLLM" in line
    assert sorted(p.name for p in out.iterdir()) == ["rot.F32.gguf"]
