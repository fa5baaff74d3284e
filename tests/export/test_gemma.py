"""What works for Gemma 3 (a tiny random one; its sliding window and post-norms as the real model has them):
the trained students of the views that export, operators and all or stock, and the rotation fold refused with
its reason. The plain and operator folders of every method are in test_writer.py, the GGUF files in
test_gguf_families.py and test_serving_gguf_families.py (llama.cpp), vLLM in test_serving_vllm.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GEMMA, fit_all, tiny_model

from ghostdistill.core.plan import PruningPlan
from ghostdistill.distill.config import DistillConfig, StudentConfig
from ghostdistill.export import export_view, load_exported
from ghostdistill.export.gguf import export_gguf, read_gguf
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.train import build_students

METHODS = {"ghost": "ghost", "mag": "magnitude", "rm": "replaceme", "rot": "rotation_through"}
STUDENTS = [
    StudentConfig(name="ghost_lora_ft", method="ghost", train=["operators", "lora"]),
    StudentConfig(name="mag_ft", method="mag", train=["operators"]),
    StudentConfig(name="rm_lora_norms_ft", method="rm", train=["lora", "norms"]),
]


@pytest.fixture(scope="module")
def students():
    torch.manual_seed(0)
    recovery = [RecoveryConfig(name=n, method=m) for n, m in METHODS.items()]
    pm, _ = fit_all(tiny_model(GEMMA), PruningPlan.from_layers([2, 3], 6), recovery)
    built = build_students(pm, DistillConfig(methods=[], students=STUDENTS), methods=METHODS)
    with torch.no_grad():
        for spec in STUDENTS:
            for p in built.params[spec.name].all():
                p.add_(torch.randn_like(p) * 0.05)  # students that moved off their closed forms
    return pm


@torch.no_grad()
@pytest.mark.parametrize("student", [s.name for s in STUDENTS])
def test_gemma_students_export_and_reload_as_the_student(students, student, tmp_path, tiny_tokenizer):
    pm = students
    spec = next(s for s in STUDENTS if s.name == student)
    method = METHODS[spec.method]
    ids = torch.randint(2, 512, (2, 16), generator=torch.Generator().manual_seed(2))  # past the 8-token window
    folder = export_view(pm, student, tmp_path / student, method=method, tokenizer=tiny_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    with pm.use(student) as view:
        expected = view(input_ids=ids).logits
    with pm.use(spec.method) as view:
        assert not torch.allclose(view(input_ids=ids).logits, expected, atol=1e-3), "the student did not move"
    torch.testing.assert_close(load_exported(folder)(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
    stock = method != "ghost"
    assert ("auto_map" in config) != stock
    if stock:  # the plain Gemma 3 architecture, also as GGUF
        (path,) = export_gguf(pm, student, tmp_path, method=method, tokenizer=tiny_tokenizer, types=["F16"])
        assert read_gguf(path)["architecture"] == "gemma3" and read_gguf(path)["block_count"] == 4


def test_gemma_rotation_fold_is_refused_with_its_reason(students, tmp_path):
    with pytest.raises(ValueError, match="norms inside the residual branch"):
        export_view(students, "rot", tmp_path / "rot", method="rotation_through")
    assert not (tmp_path / "rot").exists()
