"""The package's architecture, checked: no import cycles, lower layers never import upper ones, and
every third-party import is declared in pyproject.toml."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ghostdistill"

# Lowest first. A module may import from its own layer's modules and from lower layers only. `cli` and `api` are
# both top layers (the command line, the Python functions), beside each other: neither imports the other.
LAYERS = [
    "core",
    "methods",
    "data",
    "evaluation",
    "calibration",
    "planning",
    "analysis",
    "distill",
    "reporting",
    "export",
    "pipeline",
    "lit",
    "runner",
    "cli",
    "api",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """Every ghostdistill module a file imports (or `source`, as if it were that file), at any depth of the
    file (functions and `if TYPE_CHECKING:` blocks included), with `from x import y` counted as x.y when y
    is a module."""
    tree = ast.parse(path.read_text() if source is None else source)
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    # Imports under `if TYPE_CHECKING:` count too: an annotation-only import back is still a circle in the
    # design (two modules that each need the other to be read), so the graph has every import.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ghostdistill"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ghostdistill"):
                continue
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if candidate in MODULES else target)
    return {m for m in found if m in MODULES and m != this}


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(p) for p in FILES}
GRAPH = {module_name(p): imports_of(p) for p in FILES}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_graph_sees_imports():
    assert "ghostdistill.core.model" in GRAPH["ghostdistill.core.views"]
    assert "ghostdistill.methods.interface" in GRAPH["ghostdistill.methods.ghost"]
    assert "ghostdistill.lit.callbacks" in GRAPH["ghostdistill.runner.fit"]


def test_the_graph_sees_imports_made_for_annotations_only():
    """An import under `if TYPE_CHECKING:` is an edge of the graph: the circle methods.config ⇄
    methods.interface once hid there."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .config import RecoveryConfig\n"
    assert "ghostdistill.methods.config" in imports_of(PACKAGE / "methods" / "interface.py", source)


def test_no_two_modules_import_each_other_directly_or_in_a_circle():
    """Tarjan's strongly connected components: any component of more than one module is a cycle. A
    package's __init__ importing its own submodules is not a cycle unless a submodule imports it back."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_lower_layers_never_import_upper_ones():
    bad = []
    for module, deps in GRAPH.items():
        own = layer(module)
        if own not in LAYERS:
            continue
        for dep in deps:
            other = layer(dep)
            if other in LAYERS and LAYERS.index(other) > LAYERS.index(own):
                bad.append(f"{module} imports {dep}")
    assert not bad, "\n".join(bad)


def test_the_two_top_layers_never_import_each_other():
    crossing = [f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps if {layer(m), layer(d)} == {"cli", "api"}]
    assert not crossing, crossing


def test_every_layer_is_a_known_subpackage():
    top = {layer(m) for m in MODULES} - {None, "__main__"}
    assert top == set(LAYERS), f"update LAYERS for {top ^ set(LAYERS)}"


# Import name -> distribution name, where they differ.
DISTRIBUTIONS = {"yaml": "pyyaml", "lm_eval": "lm-eval", "pyarrow": "datasets", "huggingface_hub": "huggingface-hub"}
# Scripts the package runs under another environment's Python, with what they import there: never ghostdistill's
# own dependencies (llm-compressor cannot share an environment with vLLM and ghostdistill; `export.compressed`).
OTHER_ENVIRONMENTS = {"export/compressed_oneshot.py": {"llmcompressor", "compressed_tensors"}}


def test_every_third_party_import_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    # The package's own extras count (lm-eval is the `zeroshot` extra); the dev extra serves the tests only.
    extras = [d for name, deps in project.get("optional-dependencies", {}).items() if name != "dev" for d in deps]
    declared = {re.split(r"[<>=\[ ;!~]", d)[0].lower() for d in [*project["dependencies"], *extras]}
    stdlib = set(sys.stdlib_module_names)
    missing = set()
    for path in FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in stdlib or top == "ghostdistill":
                    continue
                if top in OTHER_ENVIRONMENTS.get(path.relative_to(PACKAGE).as_posix(), ()):
                    continue
                dist = DISTRIBUTIONS.get(top, top).lower()
                if dist not in declared and dist.replace("_", "-") not in declared:
                    missing.add(f"{top} (in {path.relative_to(PACKAGE.parent)})")
    assert not missing, f"imported but not in pyproject.toml dependencies: {sorted(missing)}"


@pytest.mark.parametrize("layer_name", LAYERS[:-1])
def test_each_layer_is_documented(layer_name):
    init = PACKAGE / layer_name / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} needs a docstring saying what the layer holds"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_350_lines(path):
    """One concept per module: a module past 350 lines holds two and should be split."""
    lines = len(path.read_text().splitlines())
    assert lines <= 350, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"


def test_the_lightning_module_stays_a_thin_shell():
    """What a hook does is a phase call (`ghostdistill.pipeline`): the module holds no phase logic."""
    lines = len((PACKAGE / "lit" / "module.py").read_text().splitlines())
    assert lines <= 250, f"lit/module.py has {lines} lines; move logic into ghostdistill.pipeline"
