"""Exporting a run folder someone sent you runs none of their code: a config.yaml that asks for the model's
own Python code (`trust_remote_code: true`) is refused unless the user passes --trust-remote-code, and the
trainer classes it names are never imported (`pipeline.trust`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.pipeline.trust import check_trust, remote_code_requests

ROOT = Path(__file__).resolve().parents[2]


def _model_with_code(tiny_dir: Path, folder: Path, marker: Path) -> Path:
    """The tiny LLaMA, plus a configuration_evil.py (named by auto_map) that writes `marker` when imported."""
    shutil.copytree(tiny_dir, folder)
    (folder / "configuration_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig\n\n\nclass EvilConfig(LlamaConfig):\n    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _edit(run: Path, change) -> None:
    path = run / "config.yaml"
    config = yaml.safe_load(path.read_text())
    change(config)
    path.write_text(yaml.safe_dump(config))


def test_remote_code_requests_are_named():
    assert remote_code_requests({"model": {"model": {"source": "x", "trust_remote_code": False}}}) == []
    asked = {"model": {"model": {"source": "org/model", "trust_remote_code": True}}}
    assert remote_code_requests(asked) == ["model.model.trust_remote_code: true (model.model.source 'org/model')"]
    with pytest.raises(PermissionError, match="--trust-remote-code"):
        check_trust(asked, Path("run/config.yaml"), trusted=False)
    check_trust(asked, Path("run/config.yaml"), trusted=True)
    for odd in ({}, {"model": None}, {"model": {"model": None}}):
        assert remote_code_requests(odd) == []


def test_exporting_a_run_folder_runs_none_of_its_authors_code(tiny_dir, text_files, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    source = _model_with_code(tiny_dir, tmp_path / "model", marker)
    run = tmp_path / "run"
    main(tiny_run_args(source, text_files, run, "--model.evaluation.analysis", "false"))
    assert not marker.exists(), "fit imported the source's code without trust_remote_code"

    # The run folder now asks for the source's code, and names a trainer callback whose module writes too.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "evil_callback.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from lightning.pytorch import Callback\n\n\nclass Evil(Callback):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(hooks))

    def ask(config):
        config["model"]["model"]["trust_remote_code"] = True
        config["trainer"]["callbacks"] = [{"class_path": "evil_callback.Evil"}]

    _edit(run, ask)
    with pytest.raises(PermissionError, match=r"trust_remote_code: true .*pass --trust-remote-code"):
        main(["export", str(run), "--views", "ghost"])
    assert not marker.exists() and not (run / "export").exists()

    # Without the request, the export completes and still runs nothing: the model loads with
    # trust_remote_code=False (transformers' own LlamaConfig), and the trainer section is not read.
    _edit(run, lambda c: c["model"]["model"].update(trust_remote_code=False))
    [folder] = main(["export", str(run), "--views", "ghost"])
    assert (folder / "config.json").is_file()
    assert not marker.exists(), "export ran code the run folder names"
    assert "evil_callback" not in sys.modules

    # With the flag the request is honoured (in a subprocess: transformers caches the imported module).
    _edit(run, lambda c: c["model"]["model"].update(trust_remote_code=True))
    subprocess.run(
        [sys.executable, "-m", "ghostdistill", "export", str(run), "--views", "ghost", "--overwrite"]
        + ["--trust-remote-code"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={
            **os.environ,
            "HF_MODULES_CACHE": str(tmp_path / "modules"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert marker.exists(), "--trust-remote-code did not honour the run's trust_remote_code"
