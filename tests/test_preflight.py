"""Every check that needs only the config, the model's config and the tokenizer fails before any data is
generated or read for calibration and before any pass is made (on an 8B model that is hours of work):
each case runs `fit` (or `frontier`) with calibration and the model's loading made to fail loudly, and
expects its own one-line error instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.data.run import RunData
from ghostdistill.lit.module import GhostDistill
from ghostdistill.pipeline import frontier
from ghostdistill.pipeline import run as run_phases


class Reached(AssertionError):
    """The run got past its checks into real work."""


@pytest.fixture
def no_work(monkeypatch):
    """Calibration data, statistics passes and (for `fit`) the model's loading raise `Reached`."""

    def refuse(*args, **kwargs):
        raise Reached("the run reached data generation, calibration or model loading before failing")

    monkeypatch.setattr(RunData, "calibration_ids", refuse)
    monkeypatch.setattr(RunData, "selection_ids", refuse)
    monkeypatch.setattr(run_phases, "calibrate", refuse)
    monkeypatch.setattr(frontier, "score_runs", refuse)
    return refuse


def _fit(tiny_dir, text_files, run, *extra):
    return tiny_run_args(tiny_dir, text_files, run, *extra, calibration_source=False)  # the demo's `generate`


def _cases(tmp_path):
    existing = tmp_path / "exported"
    (existing / "ghost").mkdir(parents=True)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    return {
        "export.views typo": (["--export.views", "[ghots]"], ValueError, r"export.views \['ghots'\] are not views"),
        "export.dir exists": (
            ["--export.views", "[ghost]", "--export.dir", str(existing)],
            FileExistsError,
            r"exported/ghost'\] exist; pass export.overwrite: true",
        ),
        "export.dir under a file": (
            ["--export.views", "[ghost]", "--export.dir", str(a_file / "out")],
            NotADirectoryError,
            r"export dir .*a_file/out cannot be made: .*a_file is a file",
        ),
        "evaluation.views typo": (
            ["--model.evaluation.views", "[dnese]"],
            ValueError,
            r"evaluation.views \['dnese'\] are not views of this run",
        ),
        "ckpt_path missing": (
            [
                "--trainer.max_steps",
                "2",
                "--model.distill.methods",
                "[ghost]",
                "--ckpt_path",
                str(tmp_path / "no.ckpt"),
            ],
            FileNotFoundError,
            r"--ckpt_path .*no.ckpt does not exist",
        ),
        "default_root_dir is a file": (
            ["--trainer.default_root_dir", str(a_file)],
            NotADirectoryError,
            r"trainer.default_root_dir .*a_file: .*is a file",
        ),
        "max_steps negative": (["--trainer.max_steps", "-5"], ValueError, r"trainer.max_steps -5: set 0"),
        "evaluation window of 1 token": (
            ["--data.evaluation.seq_len", "1"],
            ValueError,
            r"data.evaluation.seq_len 1: a scored window must hold at least 2 tokens; use 2 or more",
        ),
        "distilling without methods": (["--trainer.max_steps", "2"], RuntimeError, r"trainer.max_steps > 0 trains"),
        "exporting a fine-tuned view without steps": (
            ["--model.distill.methods", "[ghost]", "--export.views", "[ghost_ft]"],
            ValueError,
            r"export.views \['ghost_ft'\] are fine-tuned views, which trainer.max_steps 0 does not build",
        ),
        "evaluating a fine-tuned view without steps": (
            ["--model.distill.methods", "[ghost]", "--model.evaluation.views", "[ghost_ft]"],
            ValueError,
            r"evaluation.views \['ghost_ft'\] are fine-tuned views",
        ),
    }


CASES = [
    "export.views typo",
    "export.dir exists",
    "export.dir under a file",
    "evaluation.views typo",
    "ckpt_path missing",
    "default_root_dir is a file",
    "max_steps negative",
    "evaluation window of 1 token",
    "distilling without methods",
    "exporting a fine-tuned view without steps",
    "evaluating a fine-tuned view without steps",
]


@pytest.mark.parametrize("case", CASES)
def test_config_only_checks_fail_before_any_work(case, tiny_dir, text_files, tmp_path, monkeypatch, no_work):
    monkeypatch.setattr(GhostDistill, "configure_model", no_work)
    extra, error, message = _cases(tmp_path)[case]
    run = tmp_path / "run"
    with pytest.raises(error, match=message):
        main(_fit(tiny_dir, text_files, run, *extra))
    assert not list(run.glob("generated_calibration_*.pt")) and not (run / "results.json").exists()


def test_a_frontier_depth_beyond_the_blocks_fails_before_any_pass(tiny_dir, text_files, tmp_path, no_work):
    args = tiny_run_args(tiny_dir, text_files, tmp_path / "unused", layers=None, num_layers=2)
    spec = tmp_path / "frontier.yaml"
    spec.write_text(yaml.safe_dump({"base": args[2], "root": str(tmp_path / "f"), "num_layers": [2, 6]}))
    overrides = args[3:] + ["--data.selection.source", json.dumps({"source": str(text_files["txt"])})]
    with pytest.raises(ValueError, match=r"frontier num_layers 6 \(of \[2, 6\]\): .*cannot remove 6"):
        main(["frontier", str(spec), *overrides])


def _one_line(args, monkeypatch, capsys) -> str:
    """`ghostdistill <args>` ends in one `error:` line with exit status 2; that line."""
    import sys

    from ghostdistill.cli import entry

    monkeypatch.setattr(sys, "argv", ["ghostdistill", *args])
    monkeypatch.delenv("GHOSTDISTILL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        entry()
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable-endpoint"])
def test_a_hub_model_not_in_the_cache_without_the_hub_is_one_line_before_any_retry(
    offline, tiny_dir, text_files, tmp_path, monkeypatch, capsys, no_work
):
    """Issue 53: `configs/llama3_70b.yaml` offline spent 77 s in huggingface_hub's retries, then a traceback. A hub
    id that is not in the cache is refused at once, naming the model, the cache and HF_HUB_OFFLINE: offline without
    a request, and against an endpoint that does not answer after one request (transformers never tries it)."""
    import transformers
    from huggingface_hub import constants

    from ghostdistill.core import hub

    def never(*args, **kwargs):
        raise Reached("transformers tried the hub (its retries take about a minute)")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 3)
    if offline:
        monkeypatch.setattr(hub, "_unreachable", never)
    args = _fit(tiny_dir, text_files, tmp_path / "run", "--model.model.source", "nobody/no-such-model")
    line = _one_line(args, monkeypatch, capsys)
    start = f"error: model 'nobody/no-such-model' is not in the Hugging Face cache ({tmp_path / 'hub-cache'}) and "
    assert line.startswith(start) and "`hf download nobody/no-such-model`" in line, line
    if offline:
        assert "HF_HUB_OFFLINE=1 keeps the hub out of reach" in line, line
    else:
        assert "the hub cannot be reached (http://127.0.0.1:9: " in line and "set HF_HUB_OFFLINE=1" in line, line
    assert not (tmp_path / "run").exists()


def test_gpus_asked_for_on_a_machine_without_them_is_one_line_before_the_model(tmp_path, monkeypatch, capsys, no_work):
    """Issue 53: `configs/llama3_70b.yaml` (accelerator gpu, devices 8) without a GPU ended in Lightning's
    `MisconfigurationException: No supported gpu backend found!`, after the tokenizer had been fetched."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(run_phases, "load_tokenizer", lambda *a, **k: (_ for _ in ()).throw(Reached("tokenizer")))
    config = str(Path(__file__).resolve().parents[1] / "configs" / "llama3_70b.yaml")
    line = _one_line(
        ["fit", "--config", config, "--trainer.default_root_dir", str(tmp_path / "run")], monkeypatch, capsys
    )
    assert line.startswith(
        "error: trainer.accelerator 'gpu' (trainer.devices 8) asks for GPUs, and this machine has"
    ), line
    assert "--trainer.accelerator cpu --trainer.devices 1 --trainer.strategy auto" in line, line
    assert not (tmp_path / "run").exists()
