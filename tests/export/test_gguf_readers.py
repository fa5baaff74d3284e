"""Every family's GGUF file read back by transformers' own reader (`from_pretrained(dir, gguf_file=...)`), against
the exported folder of the same view: the same greedy tokens, or a warning at export, on the console and in the
model card, naming the reader and the difference (`export.gguf_header`), and then the tokens really differ.

The tiny models of tests/conftest.py, exported by a `Run` as `fit` exports (Hugging Face folder and F32 GGUF).
Two Gemma 3 variants beside the conftest one, whose 32-wide heads are scaled by 1/√32 where transformers'
reader assumes Gemma 3's 256: heads of 256 (so only the sliding pattern can differ), pruned where the survivors'
pattern is not the default one (the known case: blocks 0, 1, 4 slide and 5 is full, transformers rebuilds four
sliding blocks) and where it is (blocks 0-3, all sliding: no warning, the same tokens)."""

from __future__ import annotations

import pytest
import torch
from conftest import GEMMA, TINY_FAMILIES, tiny_config

from ghostdistill.core.model import ModelConfig
from ghostdistill.data import TextSource
from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData
from ghostdistill.export.gguf import export_gguf, gguf_path
from ghostdistill.export.gguf_header import READER, layer_types
from ghostdistill.export.options import ExportOptions
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.config import RunConfig
from ghostdistill.pipeline.run import Run
from ghostdistill.planning import PlanConfig

# (family, removed blocks, head_dim): the Gemma variants of the module docstring.
CASES = {
    **{family: (family, [2, 3], None) for family in TINY_FAMILIES},
    "gemma3": (GEMMA, [2, 3], None),
    "gemma3_heads256_pattern_differs": (GEMMA, [2, 3], 256),
    "gemma3_heads256_pattern_default": (GEMMA, [4, 5], 256),
}
# Where transformers' reader builds another model (the others: no warning, the same tokens).
WARNED = {
    "qwen3": ["with head_dim 128, not this file's 16 (the weights then do not fit: the load fails)"],
    "gemma3": [
        "with the default sliding pattern (full attention at blocks []), not this file's per-block pattern (full "
        "attention at blocks [3]): its blocks [3] get the wrong attention type and rope base",
        "with query_pre_attn_scalar 256, not this file's 32",
    ],
    "gemma3_heads256_pattern_differs": [
        "with the default sliding pattern (full attention at blocks []), not this file's per-block pattern (full "
        "attention at blocks [3]): its blocks [3] get the wrong attention type and rope base"
    ],
}


def _model(family: str, head_dim: int | None):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    if head_dim is not None:
        config.head_dim = config.query_pre_attn_scalar = head_dim
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # as conftest's tiny_model: blocks that change the residual stream
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


def _export(case: str, tmp_path, tokenizer, text_files) -> tuple[list[str], object]:
    """A `Run` of the case's model, magnitude-repaired, exported as a folder and an F32 GGUF file; returns (the
    warnings it gave, the run)."""
    family, removed, head_dim = CASES[case]
    cfg = RunConfig(
        model=ModelConfig(source=f"tiny-{case}"),
        plan=PlanConfig(layers=removed, num_layers=None, allow_edges=removed[-1] == 5),
        recovery=[RecoveryConfig(name="mag", method="magnitude")],
        data=DataConfig(
            calibration=CalibrationData(
                source=TextSource(source=str(text_files["jsonl_gz"])), num_samples=8, seq_len=32
            ),
            evaluation=EvaluationData(sources=[], seq_len=32),
        ),
    )
    warned: list[str] = []
    run = Run(cfg, model=_model(family, head_dim), tokenizer=tokenizer, log=lambda m: None, warn=warned.append)
    run.execute(evaluate=False)
    run.export(ExportOptions(views=["mag"], format=["hf", "gguf"], gguf_types=["F32"]), tmp_path)
    return warned, run


def _greedy(model, ids: torch.Tensor, new: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_reads_each_familys_gguf_as_the_folder_or_the_export_warns(
    case, tmp_path, tiny_tokenizer, text_files
):
    from transformers import AutoConfig, AutoModelForCausalLM

    warned, _ = _export(case, tmp_path, tiny_tokenizer, text_files)
    gguf = gguf_path(tmp_path, "mag", "F32").name
    folder = AutoModelForCausalLM.from_pretrained(tmp_path / "mag", dtype=torch.float32).eval()
    read = AutoConfig.from_pretrained(tmp_path, gguf_file=gguf)
    card = (tmp_path / "mag" / "README.md").read_text()
    if case not in WARNED:
        assert warned == [] and "## Warnings" not in card, warned
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf, dtype=torch.float32).eval()
        ids = torch.randint(2, 512, (1, 12), generator=torch.Generator().manual_seed(0))
        assert _greedy(loaded, ids) == _greedy(folder, ids)
        return
    expected = (
        f"{READER} reads {gguf} {'; and '.join(WARNED[case])}; llama.cpp reads it right; for transformers, and vLLM "
        "(whose GGUF loader uses the same reader), use the exported folder"
    )
    assert warned == [expected], warned
    assert f"## Warnings\n\n- {expected}\n" in card
    # The warning is needed: the config read back differs as stated, and so do the tokens (where it loads).
    if case == "qwen3":
        assert (read.head_dim, folder.config.head_dim) == (128, 16)
        with pytest.raises(RuntimeError, match="mismatch"):
            AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf, dtype=torch.float32)
        return
    assert layer_types(read) == ["sliding_attention"] * 4 and layer_types(folder.config)[3] == "full_attention"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf, dtype=torch.float32).eval()
    # Beyond the 8-token window the full-attention block sees other tokens: greedy decoding parts within 24.
    ids = torch.randint(2, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    assert _greedy(loaded, ids, 24) != _greedy(folder, ids, 24)


def test_export_gguf_warns_on_the_console_and_records_the_warning_in_the_file(tmp_path, tiny_tokenizer, capsys):
    """The `export_gguf` function (no run, no folder): the same line to its `log`, and in the file's provenance."""
    import json

    import gguf as gguf_py
    from conftest import fit_all, tiny_model

    from ghostdistill.core.plan import PruningPlan

    pm, _ = fit_all(tiny_model(GEMMA), PruningPlan.from_layers([2, 3], 6), [])
    (path,) = export_gguf(pm, "pruned", tmp_path, method=None, tokenizer=tiny_tokenizer, types=["F32"])
    out = capsys.readouterr().out
    assert f"warning: {READER} reads pruned.F32.gguf with the default sliding pattern" in out, out
    field = gguf_py.GGUFReader(str(path)).fields["ghostdistill.provenance"].contents()
    assert json.loads(field)["warnings"] == [out.strip().removeprefix("warning: ")]
