"""Folding `rotation_through` and `rotation_anchored` into the weights: the exported folder is the plain
architecture (no operator, no remote code) and computes what the in-memory view computes, here and in a fresh
process without ghostdistill; `rotation` exports as an operator view."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_FAMILIES, fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import export_view, load_exported
from ghostdistill.methods import RecoveryConfig
from ghostdistill.methods.rotation import check_foldable

METHODS = [
    RecoveryConfig(name="rot", method="rotation"),
    RecoveryConfig(name="rot_through", method="rotation_through"),
    RecoveryConfig(name="rot_anchored", method="rotation_anchored"),
]
FOLDED = {"rot_through": "rotation_through", "rot_anchored": "rotation_anchored"}


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 512, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    return ids.masked_fill(mask == 0, 1), mask


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to RMSNorm's ε (the only difference, see export.fold): 1e-4 of the logit scale."""
    scale = expected.abs().max()
    err = (got - expected).abs().max()
    assert err <= 1e-4 * scale, f"max |Δlogit| {err:.3g} vs logit scale {scale:.3g}"


def _scales(pm, view) -> list[float]:
    return [float((op.delta.double() + torch.eye(op.delta.shape[0])).norm() / 8) for op in pm.operators[view].values()]


# Two gaps (composition of rotations), and edge gaps: block 0 gone (the embedding alone before the gap) and
# the last block gone (the operator on the output of the last surviving block).
PLANS = {"two_gaps": ([1, 3, 4], False), "edges": ([0, 5], True)}


@pytest.fixture(scope="module", params=[(f, p) for f in TINY_FAMILIES for p in PLANS])
def fitted(request):
    family, plan_name = request.param
    layers, edges = PLANS[plan_name]
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model(family), PruningPlan.from_layers(layers, 6, allow_edges=edges), METHODS)
    return family, plan_name, pm


@torch.no_grad()
@pytest.mark.parametrize("view", list(FOLDED))
def test_folding_views_fold_into_the_plain_architecture(fitted, view, tmp_path, tiny_tokenizer):
    family, _, pm = fitted
    assert all(abs(c - 1) > 1e-3 for c in _scales(pm, view)), "the fit should really scale"
    folder = export_view(pm, view, tmp_path / "rt", method=FOLDED[view], tokenizer=tiny_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and not (folder / "modeling_ghostdistill.py").exists()
    assert config["num_hidden_layers"] == 6 - len(pm.plan.removed)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(plain) is type(pm.model)
    assert not any("operator" in n for n, _ in plain.named_parameters())
    ids, mask = _inputs()
    with pm.use(view) as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
        expected_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        pruned_params = sum(p.numel() for p in model.parameters())
    _close(plain(input_ids=ids, attention_mask=mask).logits, expected)
    tokens = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected_tokens), f"{family}: greedy generation differs"
    assert sum(p.numel() for p in plain.parameters()) == pruned_params  # untied models: no parameter added


# What the fresh process runs: the folder as a stock checkpoint, ghostdistill unimportable, no remote code.
RELOAD = """
import sys, torch
sys.modules["ghostdistill"] = None  # any import of ghostdistill now fails
from transformers import AutoModelForCausalLM
folder, inputs, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder).eval()
x = torch.load(inputs)
with torch.no_grad():
    logits = model(input_ids=x["ids"], attention_mask=x["mask"]).logits
    tokens = model.generate(input_ids=x["ids"], attention_mask=x["mask"], max_new_tokens=8, do_sample=False)
torch.save({"class": type(model).__module__ + "." + type(model).__name__, "logits": logits, "tokens": tokens}, out)
"""


@torch.no_grad()
@pytest.mark.parametrize("view", list(FOLDED))
def test_a_folded_folder_reloads_in_a_fresh_process_as_a_stock_checkpoint(view, tmp_path, tiny_tokenizer):
    """Two gaps on a tiny LLaMA: plain `from_pretrained` in a process where ghostdistill cannot be imported gives
    the view's logits and greedy tokens."""
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers(PLANS["two_gaps"][0], 6), METHODS[1:])
    folder = export_view(pm, view, tmp_path / view, method=FOLDED[view], tokenizer=tiny_tokenizer)
    ids, mask = _inputs()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", RELOAD, str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["class"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    with pm.use(view) as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
        expected_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    _close(out["logits"], expected)
    assert torch.equal(out["tokens"], expected_tokens), "greedy generation differs in the fresh process"


@torch.no_grad()
def test_apart_exports_as_an_operator_view(fitted, tmp_path):
    _, _, pm = fitted
    folder = export_view(pm, "rot", tmp_path / "rot", method="rotation")
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" in config and (folder / "modeling_ghostdistill.py").is_file()
    assert all(g["separate_first"] for g in config["gaps"])
    reloaded = load_exported(folder)
    ids, mask = _inputs()
    with pm.use("rot") as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask).logits, expected, atol=2e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("view", list(FOLDED))
def test_tied_embedding_is_untied(view, tmp_path):
    """The embedding takes the rotation; the head keeps the original matrix (vocab × hidden more)."""
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():  # as `tiny_model`: blocks that really change the residual stream
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    pm, _ = fit_all(model, PruningPlan.from_layers([2, 3], 6), METHODS[1:])
    folder = export_view(pm, view, tmp_path / "rt", method=FOLDED[view])
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    torch.testing.assert_close(plain.lm_head.weight, model.model.embed_tokens.weight)
    ids, mask = _inputs()
    with pm.use(view) as live:
        expected = live(input_ids=ids, attention_mask=mask).logits
        params = sum(p.numel() for p in live.parameters())
    _close(plain(input_ids=ids, attention_mask=mask).logits, expected)
    assert sum(p.numel() for p in plain.parameters()) == params + 512 * 64
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the live model stays tied"


def test_an_operator_that_is_no_rotation_is_refused(fitted, tmp_path):
    _, _, pm = fitted
    op = next(iter(pm.operators["rot_through"].values()))
    saved = op.delta.detach().clone()
    with torch.no_grad():
        op.delta[0, 1] += 0.05  # as fine-tuning would move it
    try:
        with pytest.raises(ValueError, match="not a scaled rotation"):
            export_view(pm, "rot_through", tmp_path / "rt", method="rotation_through")
    finally:
        with torch.no_grad():
            op.delta.copy_(saved)
    assert not list(tmp_path.iterdir()), "a refused export leaves nothing behind"


def test_post_norm_families_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma3_text",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    block = AutoModelForCausalLM.from_config(config).model.layers[0]
    with pytest.raises(ValueError, match="norms inside the residual branch.*post_feedforward_layernorm"):
        check_foldable(block)
    with pytest.raises(ValueError, match="not one the fold is derived for"):
        check_foldable(torch.nn.Linear(2, 2))
