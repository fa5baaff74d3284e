"""The documentation holds: every relative link of README.md and docs/**/*.md resolves, and every command
the pages show in code blocks parses.

Commands are the code-block lines that start (after optional whitespace and `VAR=value` assignments)
with `python -m ghostdistill`, `.venv/bin/python -m ghostdistill` or `ghostdistill `, and the part after
`&&` of `bash scripts/setup.sh ... && <command>` chains. `fit` commands are parsed in-process with
`--print_config`; `compare` and `export` must be known subcommands whose `--help` exits 0; script
commands (`python scripts/X.py`, `bash scripts/X.sh`) must name an existing file.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

SUBCOMMANDS = ("fit", "compare", "export", "frontier")
PYTHONS = ("python", "python3", ".venv/bin/python")
ENV = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*")
COMMAND = re.compile(r"^(?:(?:\.venv/bin/)?python3? -m ghostdistill|ghostdistill)(?:\s|$)")
SCRIPT = re.compile(r"^(?:(?:\.venv/bin/)?python3?|bash)\s+scripts/")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1", re.DOTALL)
# Placeholders a page may show in a `fit` command, and what stands in for them here.
PLACEHOLDERS = {"<yaml>": "configs/smollm2_demo.yaml", "<config>": "configs/smollm2_demo.yaml"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def strip_code(text: str) -> str:
    """The page without fenced code blocks and inline code spans (links there are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return INLINE_CODE.sub("", "\n".join(kept))


def relative_links(page: Path) -> list[str]:
    out = []
    for target in LINK.findall(strip_code(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto, ... and anchors within the page
        out.append(target.split("#", 1)[0])
    return out


@dataclass
class Command:
    page: Path
    line: int
    text: str

    @property
    def id(self) -> str:
        return f"{rel(self.page)}:{self.line}"


def code_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, logical line) of every code line: fenced blocks, and indented (4+ spaces) lines
    outside them; backslash continuations joined."""
    lines, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ") or pending):
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for number, line in code_lines(page):
            for part in line.split("&&"):
                part = ENV.sub("", part.strip())
                if COMMAND.match(part) or SCRIPT.match(part):
                    found.append(Command(page, number, part))
    return found


COMMANDS = commands()


def tokens(command: Command) -> list[str]:
    words = shlex.split(command.text, comments=True)
    return words[3:] if words[0] in PYTHONS else words[1:]  # after `python -m ghostdistill` / `ghostdistill`


def exit_code(args: list[str]):
    """`ghostdistill.cli.main(args)` in-process: its exit status (0 when it returns)."""
    from ghostdistill.cli import main

    try:
        main(args)
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page: Path) -> None:
    missing = [t for t in relative_links(page) if t and not (page.parent / t).exists()]
    assert not missing, f"{rel(page)} links to files that do not exist: {missing}"


def test_pages_show_commands() -> None:
    """The extraction finds the README's two commands (so an empty list cannot pass the tests below)."""
    readme = {c.text for c in COMMANDS if c.page.name == "README.md" and c.page.parent == ROOT}
    assert ".venv/bin/python -m ghostdistill fit --config configs/smollm2_demo.yaml" in readme
    assert "bash scripts/setup.sh --dev" in readme
    assert any(tokens(c)[:1] == ["fit"] for c in COMMANDS if COMMAND.match(c.text))


@pytest.mark.parametrize("command", [c for c in COMMANDS if SCRIPT.match(c.text)], ids=lambda c: c.id)
def test_script_commands_name_existing_scripts(command: Command) -> None:
    script = shlex.split(command.text, comments=True)[1]
    assert (ROOT / script).is_file(), f"{command.id}: {script} does not exist"


@pytest.mark.parametrize("command", [c for c in COMMANDS if COMMAND.match(c.text)], ids=lambda c: c.id)
def test_commands_parse(command: Command, monkeypatch, capsys) -> None:
    args = tokens(command)
    assert args, f"{command.id}: no subcommand"
    sub = args[0]
    assert sub in SUBCOMMANDS or sub in ("--help", "-h"), f"{command.id}: unknown subcommand {sub!r}"
    if sub in ("compare", "frontier") and len(args) > 1 and (ROOT / args[1]).is_file():
        # The file a page shows must load (its base config, its keys); its --help is checked below.
        from ghostdistill.reporting import compare, frontier

        monkeypatch.chdir(ROOT)
        (compare.load_spec if sub == "compare" else frontier.load_frontier_spec)(args[1])
    if sub != "fit":
        return  # compare / export / frontier: their --help is checked once each below
    args = [PLACEHOLDERS.get(a, a) for a in args]
    if any(re.search(r"<[^>]+>", a) for a in args):
        return  # a placeholder with no stand-in: the subcommand name is all that can be checked
    if "--print_config" not in args:
        args.append("--print_config")
    monkeypatch.chdir(ROOT)  # config paths are relative to the repository root
    code = exit_code(args)
    out = capsys.readouterr()
    assert code in (0, None), f"{command.id}: {command.text!r} exited {code!r}\n{out.err[-2000:]}"
    assert "model:" in out.out, f"{command.id}: --print_config printed no config"


def shown_subcommands() -> list[str]:
    subs = set()
    for command in COMMANDS:
        if COMMAND.match(command.text):
            args = tokens(command)
            subs.add(args[0] if args and args[0] in SUBCOMMANDS else "(none)")
    return sorted(subs - {"fit"})


@pytest.mark.parametrize("sub", shown_subcommands())
def test_help_exits_0(sub: str, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    args = ["--help"] if sub == "(none)" else [sub, "--help"]
    code = exit_code(args)
    assert capsys.readouterr().out.strip(), f"{' '.join(args)} printed nothing"
    assert code in (0, None), f"{' '.join(args)} exited {code!r}"


def test_the_readme_python_example_is_short_and_is_the_code_the_api_test_runs(monkeypatch, capsys) -> None:
    """The README's Python API block is at most ten lines of Python, and it is what
    tests/api/test_readme_example.py runs (it reads the block, `readme_example`, and runs it as it is); the
    `fit` of its settings, which that test compares it with, parses."""
    from readme_example import fit_arguments, readme_example

    code = readme_example()
    assert len(code.splitlines()) <= 10, code
    compile(code, "README.md (Python API)", "exec")
    test = (ROOT / "tests" / "api" / "test_readme_example.py").read_text()
    assert "code = readme_example()" in test and '[sys.executable, "-c", code]' in test
    monkeypatch.chdir(ROOT)
    code_ = exit_code([*fit_arguments(code, ROOT / "runs" / "readme_example"), "--print_config"])
    assert code_ in (0, None), capsys.readouterr().err[-2000:]
