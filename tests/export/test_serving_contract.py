"""What serving stacks read of a folder with operators: a flat config with the base family's keys, the base
model class vLLM's Transformers backend builds (`auto_map.AutoModel`), and folders written before the
config was flat."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.export import export_view, load_exported
from ghostdistill.methods import RecoveryConfig


@pytest.fixture(scope="module")
def ghost_folder(tmp_path_factory, tiny_tokenizer):
    torch.manual_seed(0)
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="ghost")])
    with torch.no_grad():  # a first-position shift large enough that treating the wrong token as first shows
        pm.operators["ghost"]["2-3"].first_shift.normal_(0, 2.0)
    folder = export_view(pm, "ghost", tmp_path_factory.mktemp("g") / "ghost", method="ghost", tokenizer=tiny_tokenizer)
    return pm, folder


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(2, 512, (2, 10), generator=torch.Generator().manual_seed(seed))


def test_the_config_is_flat_with_the_base_familys_keys(ghost_folder):
    """vLLM takes a text model whose config nests another for a multimodal one: the family's keys sit at
    the top, `num_hidden_layers` the surviving blocks, and `auto_map` names the base model class too."""
    pm, folder = ghost_folder
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "ghostdistill" and config["base_model_type"] == "llama"
    assert "text_config" not in config
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == pm.config.hidden_size
    assert config["num_attention_heads"] == pm.config.num_attention_heads
    assert config["architectures"] == ["GhostPrunedForCausalLM"]
    assert config["auto_map"]["AutoModel"] == "modeling_ghostdistill.GhostPrunedModel"


@torch.no_grad()
def test_the_base_model_class_gives_the_views_hidden_states(ghost_folder):
    """`AutoModel` (what vLLM builds, adding its own head) loads the same checkpoint: its last hidden states
    through the view's head are the view's logits, the first-position map included."""
    from transformers import AutoModel

    from ghostdistill.core.modeling_ghostdistill import GhostPrunedModel, register_auto_classes

    pm, folder = ghost_folder
    register_auto_classes()
    base = AutoModel.from_pretrained(folder).eval()
    assert isinstance(base, GhostPrunedModel)
    ids = _ids()
    hidden = base(input_ids=ids).last_hidden_state
    with pm.use("ghost") as model:
        expected = model(input_ids=ids).logits
        torch.testing.assert_close(model.get_output_embeddings()(hidden), expected, atol=2e-5, rtol=1e-5)
    # The first position is read from the position ids: numbering the same tokens from 1 changes the output.
    shifted = base(input_ids=ids, position_ids=torch.arange(1, 11).expand(2, 10)).last_hidden_state
    assert (shifted[:, 0] - hidden[:, 0]).abs().max() > 1e-3


@torch.no_grad()
def test_a_folder_with_a_nested_config_still_loads(ghost_folder, tmp_path):
    """Folders exported before the config was flat hold the base config nested under `text_config`."""
    import shutil

    pm, folder = ghost_folder
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    own = ("model_type", "gaps", "layers_path", "ghostdistill", "architectures", "auto_map", "transformers_version")
    nested = {k: v for k, v in config.items() if k not in (*own, "base_model_type")}
    nested["model_type"] = config["base_model_type"]
    (old / "config.json").write_text(
        json.dumps({**{k: config[k] for k in own if k in config}, "text_config": nested}, indent=2)
    )
    ids = _ids(4)
    with pm.use("ghost") as model:
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(load_exported(old)(input_ids=ids).logits, expected, atol=2e-5, rtol=1e-5)


@torch.no_grad()
def test_a_folding_view_exports_beside_a_lora_student(tmp_path):
    """LoRA students wrap the shared blocks' linears in adapter layers; a view that folds into those linears
    (magnitude, rotation_through) still exports as the plain architecture, without any adapter, and computes
    what the view computes; the student's own folder has its adapter merged."""
    from transformers import AutoModelForCausalLM

    from ghostdistill.distill.config import DistillConfig, StudentConfig
    from ghostdistill.pipeline.train import build_students

    torch.manual_seed(0)
    recovery = [RecoveryConfig(name="mag", method="magnitude"), RecoveryConfig(name="rot", method="rotation_through")]
    pm, _ = fit_all(tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), recovery)
    students = build_students(
        pm, DistillConfig(methods=[], students=[StudentConfig(name="rot_lora_ft", method="rot", train=["lora"])])
    )
    for p in students.params["rot_lora_ft"].all():
        p.normal_(0, 0.05)  # an adapter that changes the outputs
    ids = _ids(5)
    for view, method in (("mag", "magnitude"), ("rot", "rotation_through"), ("rot_lora_ft", "rotation_through")):
        folder = export_view(pm, view, tmp_path / view, method=method)
        plain = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert not any("lora" in name for name, _ in plain.named_parameters())
        with pm.use(view) as model:
            expected = model(input_ids=ids).logits
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "train",
    [["lora", "norms"], ["tail"], ["blocks"], ["operators"], ["operators", "lora", "norms"]],
    ids=["lora+norms", "tail", "blocks", "operators", "operators+lora+norms"],
)
def test_a_stock_student_exports_as_the_plain_architecture(train, tmp_path):
    """Stock students: on a folding view (`rotation_anchored`), what trains is merged at export (LoRA, norm
    gains, the tail, whole blocks) or folded (the operators, trained within the scaled rotations), so the
    folder is the plain architecture with the student's logits."""

    from ghostdistill.distill.config import DistillConfig, StudentConfig
    from ghostdistill.pipeline.train import build_students

    torch.manual_seed(0)
    model = tiny_model("llama")
    pm, _ = fit_all(model, PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="ra", method="rotation_anchored")])
    spec = StudentConfig(name="ra_ft", method="ra", train=train, **({"tail_blocks": 1} if train == ["tail"] else {}))
    students = build_students(pm, DistillConfig(methods=[], students=[spec]), methods={"ra": "rotation_anchored"})
    params = students.params["ra_ft"].all()
    assert params and bool(students.params["ra_ft"]["operators"]) == ("operators" in train)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 0.05)  # a student that moved off the closed form
    _exports_the_student_stock(pm, "ra_ft", "ra", "rotation_anchored", tmp_path)


def _exports_the_student_stock(pm, student: str, closed_form: str, method: str, tmp_path) -> None:
    """`student`'s folder is the plain architecture (no `auto_map`, no adapter) and computes the student's
    logits, which differ from its closed form's."""
    from transformers import AutoModelForCausalLM

    ids = _ids(5)
    folder = export_view(pm, student, tmp_path / student, method=method)
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not any("lora" in name for name, _ in plain.named_parameters())
    with torch.no_grad(), pm.use(student) as view:
        expected = view(input_ids=ids).logits
    with torch.no_grad(), pm.use(closed_form) as view:
        start = view(input_ids=ids).logits
    assert not torch.allclose(expected, start, atol=1e-3), "the student moved off its closed form"
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_a_freely_trained_operator_of_a_folding_method_is_refused_at_export(tmp_path):
    """Without its method's `student_operator` (a recovery name `build_students` is not told the method of),
    a rotation student trains W = I + M freely; the export refuses it instead of folding another model."""
    from ghostdistill.distill.config import DistillConfig, StudentConfig
    from ghostdistill.pipeline.train import build_students

    torch.manual_seed(0)
    pm, _ = fit_all(
        tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="ra", method="rotation_anchored")]
    )
    students = build_students(pm, DistillConfig(methods=[], students=[StudentConfig(name="ra_ft", method="ra")]))
    with torch.no_grad():
        for p in students.params["ra_ft"]["operators"]:
            p.add_(torch.randn_like(p) * 0.05)
    with pytest.raises(ValueError, match="not a scaled rotation"):
        export_view(pm, "ra_ft", tmp_path / "ra_ft", method="rotation_anchored")
    assert not (tmp_path / "ra_ft").exists()


def test_a_magnitude_student_trains_its_scale_and_folds(tmp_path):
    """`magnitude`'s student trains the scale alone (W = e^t·s·I), so its folder is the plain architecture
    with the student's logits; a W that is not a scale is refused at export rather than folded as W[0, 0]."""

    from ghostdistill.distill.config import DistillConfig
    from ghostdistill.pipeline.train import build_students

    torch.manual_seed(0)
    pm, _ = fit_all(
        tiny_model("llama"), PruningPlan.from_layers([2, 3], 6), [RecoveryConfig(name="magnitude", method="magnitude")]
    )
    students = build_students(pm, DistillConfig(methods=["magnitude"]))
    assert [p.shape for p in students.params["magnitude_ft"]["operators"]] == [torch.Size([1])]  # the scale alone
    with torch.no_grad():
        students.params["magnitude_ft"]["operators"][0].fill_(0.3)
    # A state saved when the scale was a 0-dim tensor (runs before FSDP2 needed it 1-D) loads to the same scale.
    state = students.trainable_state("magnitude_ft")
    (name,) = state
    students.params["magnitude_ft"]["operators"][0].detach().zero_()
    students.load_trainable_state("magnitude_ft", {name: state[name].reshape(())})
    assert float(students.params["magnitude_ft"]["operators"][0]) == pytest.approx(0.3)
    _exports_the_student_stock(pm, "magnitude_ft", "magnitude", "magnitude", tmp_path)
    with torch.no_grad():
        pm.operators["magnitude"][pm.plan.gaps[0].key].delta[0, 1] = 0.1
    with pytest.raises(ValueError, match="not a multiple of the identity"):
        export_view(pm, "magnitude", tmp_path / "bad", method="magnitude")
