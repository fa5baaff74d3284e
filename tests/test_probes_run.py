"""The probes of issue 53 on run folders and plans, through the script's entry point: a run never replaces a file
it did not write (an empty path, a folder of the user's, another run's folder named by a copied config), a run
folder that cannot be written or a dangling link is one line, a refused plan leaves nothing behind, a bad
number is one line, compare checks every plan before the first runs, and paths outside ASCII stay answered.
Each test's name names its class: overwrite, another_run, unwritable, dangling_link, left_behind, one_line,
late_check, kept_so."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from tiny_run import cli_error_line, tiny_run_args

from ghostdistill.cli import entry
from ghostdistill.core.run_folder import RUN_MARKER, is_run_folder


def _runs(args: list[str], monkeypatch) -> None:
    """Run `ghostdistill <args>` to the end."""
    monkeypatch.setattr(sys, "argv", ["ghostdistill", *args])
    entry()


def _no_model_load(monkeypatch) -> None:
    from ghostdistill.pipeline import run

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(run, "load_model", never)


def _users_folder(folder: Path) -> dict[str, str]:
    """A folder of the user's holding files of the names a run writes; returns their contents."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"config.yaml": "my: own config\n", "results.md": "# my notes\n", "notes.txt": "keep\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_dir, text_files) -> Path:
    """A finished training-free run of the tiny LLaMA (layers 2-3, ghost)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    sys_argv = sys.argv
    try:
        sys.argv = ["ghostdistill", *tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false")]
        entry()
    finally:
        sys.argv = sys_argv
    return run


# ------------------------------------------------------------------------------------------------- overwrite
def test_overwrite_an_empty_run_folder_path_is_refused_and_the_current_folders_files_are_kept(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    """`--trainer.default_root_dir ''` wrote the run into the current folder, replacing its config.yaml and
    results.md."""
    _no_model_load(monkeypatch)
    files = _users_folder(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    line = cli_error_line(tiny_run_args(tiny_dir, text_files, Path("x"))[:-1] + [""], capsys, monkeypatch)
    assert line.startswith("error: trainer.default_root_dir '' is empty: give the run folder, e.g. runs/my_run"), line
    assert {p.name: p.read_text() for p in (tmp_path / "cwd").iterdir()} == files


@pytest.mark.parametrize("where", ["a folder", "the current folder"])
def test_overwrite_a_folder_holding_the_users_files_is_refused_naming_them(
    where, tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    _no_model_load(monkeypatch)
    folder = tmp_path / "mine"
    files = _users_folder(folder)
    if where == "the current folder":
        monkeypatch.chdir(folder)
    given = folder if where == "a folder" else Path(".")
    line = cli_error_line(tiny_run_args(tiny_dir, text_files, given), capsys, monkeypatch)
    assert line.startswith(
        f"error: trainer.default_root_dir {given} is not a ghostdistill run folder, and a run there would replace "
        "its config.yaml, results.md: choose another (new or empty) folder"
    ), line
    assert {p.name: p.read_text() for p in folder.iterdir()} == files, "nothing written, nothing replaced"


def test_overwrite_a_run_folder_of_an_earlier_version_is_recognised_and_resumes(
    finished, tmp_path, tiny_dir, text_files, monkeypatch, caplog
):
    """A run folder written before the marker (config.yaml, results.json, calibration_state.pt of this tool) is
    this tool's: the same command runs in it again, from its saved statistics, and marks it."""
    old = tmp_path / "old"
    shutil.copytree(finished, old)
    (old / RUN_MARKER).unlink()
    for keep in ("results.json", "config.yaml", "calibration_state.pt"):  # each alone tells it is a run folder
        alone = tmp_path / f"only_{keep}"
        alone.mkdir()
        shutil.copy(old / keep, alone / keep)
        assert is_run_folder(alone), keep
    _runs(tiny_run_args(tiny_dir, text_files, old, "--model.evaluation.analysis", "false"), monkeypatch)
    assert "resuming calibration after 4/4 batches" in caplog.text, "the saved statistics were not reused"
    assert (old / RUN_MARKER).is_file()
    saved, again = (json.loads((d / "results.json").read_text()) for d in (finished, old))
    assert again["views"]["ghost"]["metrics"] == saved["views"]["ghost"]["metrics"]


# ---------------------------------------------------------------------------------------------- another run
def test_another_run_a_copied_and_edited_config_is_refused_before_it_replaces_the_run_it_came_from(
    finished, tmp_path, capsys, monkeypatch
):
    """A run's config.yaml keeps its absolute run folder: `fit --config <copy with another plan>` replaced the
    original run's results and statistics."""
    _no_model_load(monkeypatch)
    config = yaml.safe_load((finished / "config.yaml").read_text())
    config["model"]["plan"]["layers"] = [2, 4]
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(config))
    before = {p.name: p.stat().st_mtime_ns for p in finished.iterdir()}
    line = cli_error_line(["fit", "--config", str(copy)], capsys, monkeypatch)
    assert line.startswith(
        f"error: trainer.default_root_dir {finished} holds a finished run, and its results.json was computed with "
        "other model.plan.layers: this run would replace its results; give another trainer.default_root_dir (a new "
        "folder), add --overwrite_run true to replace them, or --ckpt_path last to continue that run"
    ), line
    assert {p.name: p.stat().st_mtime_ns for p in finished.iterdir()} == before


def test_another_run_overwrite_run_replaces_it_and_its_config_does_not_carry_the_flag(
    finished, tmp_path, capsys, monkeypatch
):
    """The same config into the same folder resumes without the flag; another one replaces it with the flag,
    and the config.yaml it saves says `overwrite_run: false` (a copy of it is refused again)."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["default_root_dir"] = str(run)
    same = tmp_path / "same.yaml"
    same.write_text(yaml.safe_dump(config))
    _runs(["fit", "--config", str(same)], monkeypatch)  # the same settings: no refusal
    config["model"]["plan"]["layers"] = [2, 4]
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(config))
    _runs(["fit", "--config", str(edited), "--overwrite_run", "true"], monkeypatch)
    assert json.loads((run / "results.json").read_text())["plan"]["removed"] == [2, 4]
    assert yaml.safe_load((run / "config.yaml").read_text())["overwrite_run"] is False
    config["model"]["plan"]["layers"] = [2, 3]
    edited.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    line = cli_error_line(["fit", "--config", str(edited)], capsys, monkeypatch)
    assert "computed with other model.plan.layers" in line, line


# ----------------------------------------------------------------------------- unwritable, dangling link
def test_unwritable_a_read_only_run_folder_is_one_line_naming_it(tmp_path, tiny_dir, text_files, capsys, monkeypatch):
    """`OSError: [Errno 30] Read-only file system` came as a traceback from the lock. The tests run as root, for
    whom permissions do not stop a write: the mount's refusal is simulated where the first write is tried."""
    import tempfile

    from ghostdistill.core import io

    _no_model_load(monkeypatch)
    run = tmp_path / "ro"
    run.mkdir()
    real = tempfile.mkstemp

    def read_only(*args, **kwargs):
        if Path(kwargs.get("dir") or "") == run:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(run / ".ghostdistill-probe-x"))
        return real(*args, **kwargs)

    monkeypatch.setattr(io.tempfile, "mkstemp", read_only)
    line = cli_error_line(tiny_run_args(tiny_dir, text_files, run), capsys, monkeypatch)
    assert line.startswith(f"error: trainer.default_root_dir {run} cannot be written: {run}/.ghostdistill-probe-x: "), (
        line
    )
    assert "Read-only file system; choose a folder you can write" in line
    assert list(run.iterdir()) == []


def test_unwritable_the_lock_of_a_read_only_folder_iscli_error_line(tmp_path):
    """The lock of a folder on a read-only mount (compare's and frontier's roots take it directly)."""
    from ghostdistill.core import lock

    def read_only(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    original, lock._acquire = lock._acquire, read_only
    try:
        with pytest.raises(PermissionError) as info, lock.hold_folder(tmp_path, "test", ""):
            pass
    finally:
        lock._acquire = original
    assert str(info.value) == (
        f"{tmp_path} is not writable (Read-only file system: {tmp_path / lock.RUN_LOCK}): its lock file cannot be "
        "made; choose a folder you can write"
    )


def test_dangling_link_as_run_folder_is_one_line_naming_its_target(tmp_path, tiny_dir, text_files, capsys, monkeypatch):
    """It gave `[Errno 17] File exists`."""
    _no_model_load(monkeypatch)
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone" / "run")
    line = cli_error_line(tiny_run_args(tiny_dir, text_files, link), capsys, monkeypatch)
    assert line.startswith(
        f"error: trainer.default_root_dir {link} is a symbolic link to {tmp_path / 'gone' / 'run'}, which does not "
        "exist: create that folder, or give another run folder"
    ), line
    assert link.is_symlink() and not (tmp_path / "gone").exists()


# ------------------------------------------------------------------------------------------- left behind
def test_left_behind_nothing_by_a_plan_the_models_depth_refuses(tmp_path, tiny_dir, text_files, capsys, monkeypatch):
    """`--model.plan.num_layers 1000` left an empty run folder; it is refused before the model loads."""
    _no_model_load(monkeypatch)
    run = tmp_path / "runs" / "r"
    args = tiny_run_args(tiny_dir, text_files, run, layers=None, num_layers=1000)
    line = cli_error_line(args, capsys, monkeypatch)
    assert "plan.num_layers 1000 with plan.criterion 'streamline': cannot remove 1000 contiguous layers from 6" in line
    assert list(tmp_path.iterdir()) == []


def test_left_behind_nothing_by_a_run_refused_after_its_folder_was_made(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    """A check that needs the loaded model (an evaluation window longer than the text) fails after the run folder
    was made: the folders this run made go again; a folder that was there stays, with what it held."""
    run = tmp_path / "runs" / "r"
    args = tiny_run_args(tiny_dir, text_files, run, "--data.evaluation.seq_len", "100000")
    assert "is fewer than one window of seq_len=100000" in cli_error_line(args, capsys, monkeypatch)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "notes.txt").write_text("keep")
    args = tiny_run_args(tiny_dir, text_files, tmp_path / "there", "--data.evaluation.seq_len", "100000")
    cli_error_line(args, capsys, monkeypatch)
    assert (tmp_path / "there" / "notes.txt").read_text() == "keep"


# ---------------------------------------------------------------------------------------------- one line
@pytest.mark.parametrize(
    "value, expected",
    [("2.5", "model.plan.num_layers 2.5: expected an integer or null"), ("seven", "model.plan.num_layers seven: ")],
)
def test_one_line_a_number_of_layers_that_is_no_integer_names_the_key_and_what_is_valid(
    value, expected, tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    """It printed the usage of every key (152 lines) before the error."""
    _no_model_load(monkeypatch)
    args = tiny_run_args(tiny_dir, text_files, tmp_path / "r", "--model.plan.num_layers", value, layers=None)
    line = cli_error_line(args, capsys, monkeypatch)
    assert line.startswith(f"error: {expected}"), line
    assert not (tmp_path / "r").exists()


# -------------------------------------------------------------------------------------------- late checks
def test_late_check_compare_refuses_an_impossible_plan_before_the_first_plan_runs(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    """A second plan of 9 blocks of a 6-block model ran the first plan in full, then failed without naming the
    plan, leaving an empty plan folder and no compare.md."""
    _no_model_load(monkeypatch)
    base = tiny_run_args(tiny_dir, text_files, tmp_path / "unused")
    spec = tmp_path / "compare.yaml"
    plans = [{"layers": [2, 3]}, {"num_layers": 9}]
    spec.write_text(yaml.safe_dump({"base": base[2], "root": str(tmp_path / "cmp"), "plans": plans}))
    line = cli_error_line(["compare", str(spec), *base[3:-2]], capsys, monkeypatch)
    assert line.startswith(
        f"error: {spec}: plan streamline_9: plan.num_layers 9 with plan.criterion 'streamline': cannot remove 9 "
        "contiguous layers from 6"
    ), line
    assert not (tmp_path / "cmp").exists()


def test_late_check_compare_refuses_a_plan_folder_of_the_users_before_the_first_plan_runs(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    _no_model_load(monkeypatch)
    base = tiny_run_args(tiny_dir, text_files, tmp_path / "unused")
    spec = tmp_path / "compare.yaml"
    plans = [{"layers": [2, 3]}, {"layers": [3, 4]}]
    spec.write_text(yaml.safe_dump({"base": base[2], "root": str(tmp_path / "cmp"), "plans": plans}))
    files = _users_folder(tmp_path / "cmp" / "layers_3_4")
    line = cli_error_line(["compare", str(spec), *base[3:-2]], capsys, monkeypatch)
    assert line.startswith(
        f"error: {spec}: plan layers_3_4: its run folder {tmp_path / 'cmp' / 'layers_3_4'} is not a ghostdistill run "
        "folder, and a run there would replace its config.yaml, results.md"
    ), line
    assert not (tmp_path / "cmp" / "layers_2_3").exists()
    assert {p.name: p.read_text() for p in (tmp_path / "cmp" / "layers_3_4").iterdir()} == files


# --------------------------------------------------------------------------------------------- kept so
def test_kept_so_unicode_paths_of_the_model_the_data_the_run_and_the_export(tmp_path, tiny_dir, text_files):
    """Issue 53 found paths outside ASCII answered well: keep them so. A model folder, data files, a run folder
    and an export folder so named: the run finishes, its files name them, and the exported view loads."""
    from transformers import AutoModelForCausalLM

    from ghostdistill.cli import main

    model = tmp_path / "modèle 模型"
    shutil.copytree(tiny_dir, model)
    data = {key: tmp_path / f"données {path.name}" for key, path in text_files.items()}
    for key, path in data.items():
        shutil.copy(text_files[key], path)
    run, export = tmp_path / "exécution ラン", tmp_path / "exporté"
    main(tiny_run_args(model, data, run, "--export.views", "[pruned]", "--export.dir", str(export),
                       "--model.evaluation.analysis", "false"))  # fmt: skip
    results = json.loads((run / "results.json").read_text(encoding="utf-8"))
    saved = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    assert results["plan"]["removed"] == [2, 3] and saved["model"]["model"]["source"] == str(model)
    assert AutoModelForCausalLM.from_pretrained(export / "pruned").config.num_hidden_layers == 4
