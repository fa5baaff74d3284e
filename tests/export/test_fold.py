"""Folding `rotation_through` into the weights: the exported folder is the plain architecture (no operator,
no remote code) and computes what the in-memory view computes; `rotation` exports as an operator view."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_FAMILIES, fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import export_view, load_exported
from ghostdistill.export.fold import check_foldable
from ghostdistill.methods import RecoveryConfig

METHODS = [
    RecoveryConfig(name="rot", method="rotation"),
    RecoveryConfig(name="rot_through", method="rotation_through"),
]


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
def test_through_folds_into_the_plain_architecture(fitted, tmp_path, tiny_tokenizer):
    family, _, pm = fitted
    assert all(abs(c - 1) > 1e-3 for c in _scales(pm, "rot_through")), "the fit should really scale"
    folder = export_view(pm, "rot_through", tmp_path / "rt", method="rotation_through", tokenizer=tiny_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and not (folder / "modeling_ghostdistill.py").exists()
    assert config["num_hidden_layers"] == 6 - len(pm.plan.removed)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(plain) is type(pm.model)
    assert not any("operator" in n for n, _ in plain.named_parameters())
    ids, mask = _inputs()
    with pm.use("rot_through") as model:
        expected = model(input_ids=ids, attention_mask=mask).logits
        expected_tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        pruned_params = sum(p.numel() for p in model.parameters())
    _close(plain(input_ids=ids, attention_mask=mask).logits, expected)
    tokens = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens, expected_tokens), f"{family}: greedy generation differs"
    assert sum(p.numel() for p in plain.parameters()) == pruned_params  # untied models: no parameter added


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
def test_tied_embedding_is_untied(tmp_path):
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
    folder = export_view(pm, "rot_through", tmp_path / "rt", method="rotation_through")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    torch.testing.assert_close(plain.lm_head.weight, model.model.embed_tokens.weight)
    ids, mask = _inputs()
    with pm.use("rot_through") as live:
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
