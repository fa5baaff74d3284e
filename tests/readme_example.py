"""The README's Python API example, read from README.md (one source of truth): its code block, the keywords
of its `ghostdistill.load` and `ghostdistill.repair` calls, the folder it saves to, and the `fit` arguments of
the same settings. Imported by tests/test_docs.py (the block is short and is what the API test runs) and
tests/api/test_readme_example.py (which runs it)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    """The ```python block of the README's "Python API" section."""
    section = (ROOT / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1, f"the README's Python API section holds {len(blocks)} python blocks, not one"
    return blocks[0]


def calls(code: str, name: str) -> list[ast.Call]:
    """The calls of `<x>.<name>(...)` in `code`."""
    return [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name
    ]


def call_arguments(code: str, name: str) -> tuple[list, dict]:
    """The literal positional (constants only) and keyword arguments of the one `<x>.<name>(...)` call."""
    (call,) = calls(code, name)
    args = [a.value for a in call.args if isinstance(a, ast.Constant)]
    return args, {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def prompt_text(code: str) -> str:
    """The text the example generates from (what `prompt = tokenizer(...)` encodes)."""
    (node,) = [
        n
        for n in ast.walk(ast.parse(code))
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id == "prompt"
    ]
    return ast.literal_eval(node.value.args[0])


def saved_folder(code: str) -> str:
    """The folder the example's model is saved to (its `save_pretrained` argument)."""
    (call,) = [c for c in calls(code, "save_pretrained") if getattr(c.func.value, "id", None) == "repaired"]
    return ast.literal_eval(call.args[0])


def fit_arguments(code: str, run: Path) -> list[str]:
    """`python -m ghostdistill fit` arguments of the example's settings: the demo's config (the same model, the
    same data-free calibration) with the example's model, depth, method and calibration size, evaluating one
    window only, exporting the method's view to `<run>/export/<method>`."""
    (source,), _ = call_arguments(code, "load")
    _, repair = call_arguments(code, "repair")
    method = repair["method"]
    return [
        "fit", "--config", str(ROOT / "configs" / "smollm2_demo.yaml"),
        "--model.model.source", source,
        "--model.plan.num_layers", str(repair["num_layers"]),
        "--model.recovery", json.dumps([{"name": method, "method": method}]),
        "--data.calibration.num_samples", str(repair["num_samples"]),
        "--data.calibration.seq_len", str(repair["seq_len"]),
        "--data.evaluation.max_windows", "1",
        "--model.evaluation.analysis", "false",
        "--export.views", json.dumps([method]),
        "--trainer.default_root_dir", str(run),
    ]  # fmt: skip
