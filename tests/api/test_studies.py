"""`ghostdistill.compare` and `ghostdistill.frontier` on the tiny LLaMA: each writes the files the command
writes for the same spec, with the same numbers, and returns the report it wrote; a bad argument is one
`GhostdistillError` line naming it before any work."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny_run import ROOT, frontier_file, tiny_run_args

import ghostdistill
from ghostdistill.cli import main


def files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def written_as_by_the_command(report: dict, api, cli, name: str, key: tuple[str, ...]) -> dict:
    """The API's root holds the files the command's root holds, the report is what its `<name>`.json holds, and
    every row's perplexity is the command's. Returns the perplexities by `key`."""
    assert files(api) == files(cli) and f"{name}.md" in files(api)
    assert json.loads(json.dumps(report)) == json.loads((api / f"{name}.json").read_text())
    written = json.loads((cli / f"{name}.json").read_text())
    ppl = {tuple(r[k] for k in key): r["ppl"] for r in report["rows"]}
    assert ppl == {tuple(r[k] for k in key): r["ppl"] for r in written["rows"]}
    return ppl


def test_compare_writes_what_the_command_writes(tiny_dir, text_files, tmp_path):
    base = tiny_run_args(tiny_dir, text_files, tmp_path / "unused")
    overrides = [*base[3:-2], "--model.evaluation.analysis", "false"]
    spec = {"base": base[2], "plans": [{"layers": [2, 3]}]}
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump({**spec, "root": str(tmp_path / "cli")}))
    cli = main(["compare", str(path), *overrides])
    api = tmp_path / "api"
    report = ghostdistill.compare({**spec, "root": str(api)}, tuple(overrides))
    ppl = written_as_by_the_command(report, api, cli, "compare", ("plan", "view", "source"))
    assert f"{ppl[('layers_2_3', 'ghost', 'held_out')]:.2f}" in (api / "compare.md").read_text()


def test_frontier_writes_what_the_command_writes(tiny_dir, text_files, tmp_path):
    path, overrides = frontier_file(tmp_path, tiny_dir, text_files, [1])
    spec = {**yaml.safe_load(path.read_text()), "criteria": ["streamline"]}
    path.write_text(yaml.safe_dump(spec))
    cli = main(["frontier", str(path), *overrides])
    api = tmp_path / "api"
    report = ghostdistill.frontier({**spec, "root": str(api)}, overrides)
    ppl = written_as_by_the_command(report, api, cli, "frontier", ("blocks_removed", "criterion", "view"))
    assert {(n, c) for n, c, view in ppl if view != "dense"} == {(1, "streamline")}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ghostdistill.compare(42), "compare() spec=42: give the compare file's path or a mapping"),
        (lambda: ghostdistill.compare("c.yaml", "--data.batch_size 2"), "give a list of fit arguments"),
        (lambda: ghostdistill.compare({"base": "configs/smollm2_demo.yaml"}), "(given as a mapping): missing 'plans'"),
        (lambda: ghostdistill.frontier(ROOT / "no_such_frontier.yaml"), "no_such_frontier.yaml' does not exist"),
        (lambda: ghostdistill.frontier("f.yaml", ["--data.batch_size", 2]), "overrides item 2: each fit argument"),
        (
            lambda: ghostdistill.frontier({"base": "configs/smollm2_demo.yaml", "num_layers": [0]}),
            "num_layers [0] must name depths",
        ),
    ],
)
def test_mistakes_are_one_line_ghostdistill_errors(call, message, monkeypatch):
    """The spec or the overrides of the wrong kind, and the command's own checks of the spec, before any run."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(ghostdistill.GhostdistillError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)
