"""llama.cpp serves the GGUF files of every family the writer covers, and its own tools make the k-quants.

- Tiny random LLaMA, Mistral, Qwen2, Qwen3 and Gemma 3 models, 2 of 6 blocks removed: the pruned view and the
  folded ones (magnitude; `rotation_through` where the family folds it) go through `export_gguf` as F32 and
  `llama-greedy-ids` continues prompts longer than Gemma's sliding window token for token as transformers does
  (so the survivors' sliding pattern, which llama.cpp's default would get wrong, decides the tokens).
- A k-quant: a tiny LLaMA whose rows are 256 wide (a k-quant block; narrower rows fall back to 32-value types)
  exported as Q4_K_M by `llama-quantize`, with the importance matrix `llama-imatrix` computes over the
  calibration windows and without it: the file's types and keys, and the matrix doing its job (the output
  error of the quantized matrix on the calibration activations is smaller with it).

Opt-in, as the other serving checks: it needs llama.cpp's tools (`bash scripts/serving/llama_cpp.sh` builds
them into .serve/llama.cpp; GHOSTDISTILL_LLAMA_CPP names another build) and skips, with the reason, where they
are absent. About a minute on 2 CPU cores."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import GEMMA, TINY_FAMILIES, fit_all, tiny_config, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export.gguf import export_gguf, gguf_path, read_gguf
from ghostdistill.methods import RecoveryConfig

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("GHOSTDISTILL_LLAMA_CPP", ROOT / ".serve" / "llama.cpp"))
TOOLS = ("llama-greedy-ids", "llama-quantize", "llama-imatrix", "llama-tokenize")
pytestmark = pytest.mark.serving


@pytest.fixture(scope="module", autouse=True)
def tools():
    missing = [t for t in TOOLS if not (LLAMA_CPP / "bin" / t).is_file()]
    if missing:
        pytest.skip(f"{LLAMA_CPP}: {missing} not built; `bash scripts/serving/llama_cpp.sh` builds them")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GHOSTDISTILL_LLAMA_CPP", str(LLAMA_CPP))  # what export_gguf's k-quants use
        yield


def llama_greedy(model: Path, prompts: list[list[int]], new: int, f32: bool = True) -> list[list[int]]:
    stdin = "\n".join(" ".join(map(str, p)) for p in prompts) + "\n"
    cmd = [str(LLAMA_CPP / "bin" / "llama-greedy-ids"), str(model), str(new)] + (["f32"] if f32 else [])
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return [[int(t) for t in line.split()] for line in done.stdout.splitlines() if line.strip()]


@torch.no_grad()
def hf_greedy(pm, view: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    with pm.use(view) as model:
        return [
            model.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


@pytest.mark.parametrize("family", (*TINY_FAMILIES, GEMMA))
def test_each_family_serves_in_llama_cpp_token_for_token(family, tmp_path, tiny_tokenizer):
    methods = [RecoveryConfig(name="mag", method="magnitude")]
    if family != GEMMA:
        methods.append(RecoveryConfig(name="rot", method="rotation_through"))
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model(family), PruningPlan.from_layers([2, 3], 6), methods)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 12, 20)]  # window: 8 (Gemma)
    for view in [v for v in ("pruned", "mag", "rot") if v in pm.views]:
        method = {"mag": "magnitude", "rot": "rotation_through"}.get(view)
        (path,) = export_gguf(pm, view, tmp_path, method=method, tokenizer=tiny_tokenizer, types=["F32"])
        assert read_gguf(path)["block_count"] == 4
        expected = hf_greedy(pm, view, prompts, 16)
        assert llama_greedy(path, prompts, 16) == expected, f"{family}/{view}: llama.cpp's tokens differ"


def _wide_llama():
    """A tiny LLaMA whose rows are 256 wide, one k-quant block (hidden 256, MLP 512, 4 heads of 64)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.update({"hidden_size": 256, "intermediate_size": 512})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def test_q4_k_m_comes_from_llama_quantize_and_the_importance_matrix_does_its_job(tmp_path, tiny_tokenizer, text_corpus):
    pm, _ = fit_all(_wide_llama(), PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="mag", method="magnitude")])
    ids = tiny_tokenizer("\n\n".join(text_corpus[:60])).input_ids
    windows = torch.tensor(ids[: 8 * 64]).view(8, 64)
    paths = {}
    for imatrix in (True, False):
        root = tmp_path / ("imatrix" if imatrix else "plain")
        (paths[imatrix],) = export_gguf(
            pm, "mag", root, method="magnitude", tokenizer=tiny_tokenizer, types=["Q4_K_M"],
            imatrix=imatrix, calibration=lambda: windows, log=lambda m: None,
        )  # fmt: skip
        assert sorted(p.name for p in root.iterdir()) == ["mag.Q4_K_M.gguf"]  # the F32 source and matrix are gone
    readers = {k: gguf.GGUFReader(str(p)) for k, p in paths.items()}
    for imatrix, reader in readers.items():
        fields = reader.fields
        assert int(fields["general.file_type"].contents()) == gguf.LlamaFileType.MOSTLY_Q4_K_M
        assert fields["ghostdistill.view"].contents() == "mag"  # our keys survive llama-quantize
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_norm.weight"] == "F32"
        assert ("quantize.imatrix.chunks_count" in fields) == imatrix
    assert int(readers[True].fields["quantize.imatrix.chunks_count"].contents()) == 8  # every window, one chunk each
    # The matrix weights each input column by its activations' mean square: the quantized ffn_up's output error on
    # the calibration activations (captured here, in transformers) is smaller with it than rounding to nearest.
    inputs = []
    with pm.use("mag") as model:
        up = model.model.layers[0].mlp.up_proj
        hook = up.register_forward_hook(lambda m, a, out: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
        model(input_ids=windows)
        hook.remove()
        weight = up.weight.double()
    x = torch.cat(inputs).double()
    errors = {}
    for imatrix, reader in readers.items():
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
        w = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64))
        errors[imatrix] = float((x @ (w.reshape(weight.shape) - weight).T).square().mean())
    assert errors[True] < errors[False], errors
    # llama.cpp runs the 4-bit file.
    assert len(llama_greedy(paths[True], [windows[0, :16].tolist()], 8, f32=False)[0]) == 8
    assert gguf_path(tmp_path / "plain", "mag", "Q4_K_M") == paths[False]
