"""Docs that tests keep true: the layout block of docs/development.md names every module and script that
exists (and nothing that does not), docs/how-it-works.md's subcommand table is the CLI's, every number of
the README's results table appears in the results pages it links to, and a view's figure is printed the
same on every page, and the README states no wall-clock time (it goes stale)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ghostdistill"


def layout_sections() -> dict[str, str]:
    """The layout block's entries: the top-level name (``core/``, ``cli.py``, ``scripts/``) → its text."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("<!-- layout -->", 1)[1].split("<!-- /layout -->", 1)[0]
    sections: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        head = re.match(r"^(  )?([\w.]+/?|[\w]+\.py)\s", line + " ")
        if head and not line.startswith("   "):
            name = ("ghostdistill/" if head.group(1) else "") + head.group(2)
            sections[name] = ""
        if name is not None:
            sections[name] += " " + line
    return sections


SECTIONS = layout_sections()
PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_the_layout_block_is_read():
    assert "ghostdistill/core/" in SECTIONS and "scripts/" in SECTIONS and "ghostdistill/cli/" in SECTIONS


@pytest.mark.parametrize("package", PACKAGES)
def test_the_layout_block_names_every_module_of_a_package_and_no_other(package):
    entry = SECTIONS.get(f"ghostdistill/{package}/")
    assert entry is not None, f"docs/development.md's layout block has no entry for ghostdistill/{package}/"
    files = {p.name for p in (PACKAGE / package).glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.name for p in (PACKAGE / package).iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    named = set(re.findall(r"\b(\w+\.py)\b", entry)) - {"__init__.py"}
    assert not files - named, f"ghostdistill/{package}/: the layout block does not name {sorted(files - named)}"
    assert not named - files, (
        f"ghostdistill/{package}/: the layout block names {sorted(named - files)}, which do not exist"
    )
    missing = [s for s in subpackages if f"{s}/" not in entry]
    assert not missing, f"ghostdistill/{package}/: the layout block does not name the sub-packages {missing}"


def test_the_layout_block_has_no_entry_for_a_package_that_is_gone():
    packages = [n for n in SECTIONS if re.fullmatch(r"ghostdistill/\w+/", n)]
    gone = [n for n in packages if n.split("/")[1] not in PACKAGES]
    assert not gone, f"the layout block names packages that do not exist: {gone}"


def test_the_layout_block_names_every_script():
    entry = SECTIONS["scripts/"]
    scripts = {
        p.relative_to(ROOT / "scripts").as_posix() for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh")
    }
    named = set(re.findall(r"\b([\w/]+\.(?:py|sh))\b", entry))
    missing = sorted(s for s in scripts if s not in named and Path(s).name not in named)
    assert not missing, f"docs/development.md's layout block does not name scripts {missing}"
    absent = sorted(n for n in named if not any(s == n or Path(s).name == n for s in scripts))
    assert not absent, f"the layout block names scripts that do not exist: {absent}"


def test_the_subcommand_table_is_the_clis():
    from ghostdistill.cli import COMMANDS

    SUBCOMMANDS = list(COMMANDS)
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    table = re.findall(r"^\| `(\w+)[ `]", text.split("## The command line", 1)[1].split("\n## ", 1)[0], re.M)
    words = ["zero", "one", "two", "three", "four", "five", "six"]
    assert table == SUBCOMMANDS
    assert f"lists the {words[len(SUBCOMMANDS)]} subcommands" in text
    readme = (ROOT / "README.md").read_text()
    assert f"lists the {words[len(SUBCOMMANDS)]} subcommands" in readme


def test_every_number_of_the_readme_results_table_is_on_the_pages_it_links_to():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    after = section.split(table.splitlines()[-1], 1)[1].split("\n\n", 2)[1]  # the paragraph under the table
    pages = re.findall(r"\]\((docs/results/[\w-]+\.md)\)", after)
    assert pages, "the paragraph under the README's results table links to no results page"
    text = "".join((ROOT / p).read_text() for p in pages)
    numbers = set(re.findall(r"\d+\.\d+", table))
    missing = sorted(n for n in numbers if n not in text)
    assert numbers and not missing, f"README results numbers not on {pages}: {missing}"


def test_a_views_figure_reads_the_same_on_every_page():
    """Two figures one hundredth apart in rows of the same view on different pages are one measurement
    printed twice with a different rounding or from a stale run (pruned at 11 blocks was 400.79 on some
    pages and 400.78 on others): print the same digits everywhere, or say on the page why they differ."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for page in pages:
        for line in page.read_text().splitlines():
            if not line.startswith("|") or line.startswith("|---"):
                continue
            label = line.strip("|").split("|")[0].strip()
            if not re.fullmatch(r"[a-z][a-z_]*", label):  # view rows only (a depth or a plan labels others)
                continue
            for n in re.findall(r"(?<![\d.])\d{2,}\.\d{2}(?!\d)", line):
                seen[label][n].add(page.relative_to(ROOT).as_posix())
    drift = []
    for label, numbers in seen.items():
        values = sorted(numbers, key=float)
        for a, b in zip(values, values[1:]):
            if round(float(b) - float(a), 2) == 0.01 and numbers[a] != numbers[b]:
                drift.append(f"{label}: {a} on {sorted(numbers[a])}, {b} on {sorted(numbers[b])}")
    assert not drift, "\n".join(drift)


RECIPES = ("a method", "a criterion", "a student part", "an export format")


def recipes() -> dict[str, str]:
    """docs/development.md's "How to add ..." recipes, by what they add."""
    text = (ROOT / "docs" / "development.md").read_text()
    out = {}
    for what in RECIPES:
        section = text.split(f"### How to add {what}\n", 1)
        assert len(section) == 2, f'docs/development.md has no "How to add {what}" recipe'
        out[what] = section[1].split("\n#", 1)[0]
    return out


def _has(cls: type, member: str) -> bool:
    return hasattr(cls, member) or any(member in getattr(k, "__annotations__", {}) for k in cls.__mro__)


@pytest.mark.parametrize("what", RECIPES)
def test_each_how_to_add_recipe_names_one_file_a_base_class_its_members_and_a_register_that_exist(what):
    """A recipe names the one file to write, a base class ("a `...` subclass that sets") that has every
    member the recipe names, and one `register`; every name resolves; and tests/test_extending.py, which adds
    one of each from outside the package, subclasses that base class and calls that `register`."""
    import importlib
    import inspect

    recipe = recipes()[what]
    assert "Write one module" in recipe, f"{what}: the recipe names the one file to write"
    objects = {}
    for name in re.findall(r"`(ghostdistill(?:\.\w+)+)`", recipe):
        module, _, attr = name.rpartition(".")
        objects[name] = getattr(importlib.import_module(module), attr)
    (base,) = re.findall(r"`(ghostdistill[\w.]+)` subclass that sets", recipe)
    (register,) = [n for n, o in objects.items() if n.endswith(".register") and not inspect.isclass(o)]
    members = set(re.findall(r"`(\w+)`", recipe))
    missing = sorted(m for m in members if not _has(objects[base], m))
    assert not missing, f"{what}: {base} has no {missing}, which the recipe names"
    extending = (ROOT / "tests" / "test_extending.py").read_text()
    for name in (base, register):
        short = ".".join(name.split(".")[-2:])
        assert f"{short}" in extending, f"tests/test_extending.py does not use {name} ({what})"


def test_the_readme_states_no_wall_clock_time():
    """Issue 53: the README said setup plus demo took 9 min 52 s, measured once and 5 to 9 minutes since. A time
    goes stale with the machine and the code: the README states none (the pages that measure say their commit)."""
    readme = (ROOT / "README.md").read_text()
    times = re.findall(r"\b\d+(?:\.\d+)? ?(?:min|minutes?|s|sec|seconds?|h|hours?)\b", readme)
    assert not times, f"README states wall-clock times {times}: give them on a page that names the commit measured"
