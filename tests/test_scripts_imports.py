"""scripts/ imports the package normally and its own shared modules without a circle, and nothing reaches a
script through `sys.path`: a script is run (`python scripts/x.py`; its folder is then the first entry of the
path, so `scripts/serving/` is the namespace `serving`), and what a test calls lives in the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def script_modules() -> dict[str, Path]:
    """Module name -> file, as a script run from scripts/ imports it (`_rehearsal`, `serving.check_llama_cpp`)."""
    return {".".join(p.relative_to(SCRIPTS).with_suffix("").parts): p for p in sorted(SCRIPTS.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The script modules `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def test_the_graph_sees_the_scripts_imports():
    modules = script_modules()
    assert "_rehearsal" in imports_of(SCRIPTS / "rehearsal_offload.py", modules)
    assert "serving.check_llama_cpp" in imports_of(SCRIPTS / "check_serving.py", modules)


def test_no_two_scripts_import_each_other_directly_or_in_a_circle():
    modules = script_modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    cycles, state = [], {}  # state: 1 while on the path being walked, 2 once every path from it is walked

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycles.append(path[path.index(other) :] + [other])
            elif other not in state:
                walk(other, [*path, other])
        state[name] = 2

    for name in graph:
        if name not in state:
            walk(name, [name])
    assert not cycles, f"import circles in scripts/: {cycles}"


def test_nothing_reaches_a_script_through_sys_path():
    """No script puts a folder on `sys.path`, and no test imports a script through it."""
    offenders = []
    for path in [*SCRIPTS.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("insert", "append")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "path"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "sys"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"sys.path changed in {offenders}"
