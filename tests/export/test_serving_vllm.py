"""vLLM serves what ghostdistill exports, token for token (SmolLM2-135M at 7 removed blocks): a plain folder
(pruned) through vLLM's own model, the folded ones (rotation_through, rotation_anchored) likewise, and a folder
with operators (ghost) through vLLM's Transformers backend and the folder's `modeling_ghostdistill.py`.

Opt-in: it needs the serving environment (`bash scripts/setup.sh --serve` makes `.venv-serve`, ghostdistill and
vLLM in one environment; or name its python in GHOSTDISTILL_VLLM_PYTHON) and is skipped, with the reason, where
it is absent. About 3 minutes on 2 CPU cores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GEMMA, serving_run, tiny_model
from tiny_run import tiny_run_args

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("GHOSTDISTILL_VLLM_PYTHON", ROOT / ".venv-serve" / "bin" / "python"))


def _has_vllm() -> str | None:
    """Why vLLM cannot run here, or None."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON} does not exist: `bash scripts/setup.sh --serve` makes the serving environment"
    done = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True, check=False)
    return None if done.returncode == 0 else f"vllm does not import under {VLLM_PYTHON}: {done.stderr[-300:]}"


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serves_plain_folded_and_operator_exports_token_for_token(tmp_path):
    why = _has_vllm()
    if why:
        pytest.skip(why)
    run = serving_run(tmp_path)
    out = tmp_path / "serving.json"
    check = [
        sys.executable, str(ROOT / "scripts" / "check_serving.py"), str(run), "--views", "pruned", "ghost",
        "rotation_through", "rotation_anchored", "--dir", str(tmp_path / "served"), "--stacks", "transformers", "vllm",
        "--vllm-python", str(VLLM_PYTHON), "--new", "12", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["views"]["ghost"]["kind"] == "operators"
    for view in ("rotation_through", "rotation_anchored"):
        assert report["views"][view]["kind"] == report["views"]["pruned"]["kind"] == "plain", view
    for view, r in report["views"].items():
        assert r["transformers"]["same_tokens_as_run"], f"{view}: the exported folder's tokens differ from the run's"
        assert abs(r["transformers"]["ppl"] - r["ppl_run"]) / r["ppl_run"] < 1e-4, view
        assert r["vllm"]["same_tokens"], f"{view}: vLLM's greedy tokens differ from transformers'"
        assert r["vllm"]["within_tolerance"], (
            f"{view}: vLLM's perplexity {r['vllm']['ppl']} vs {r['transformers']['ppl']}"
        )
    shutil.rmtree(tmp_path / "served")  # 4 float32 folders; the llama.cpp check beside this one needs the disk


@pytest.mark.slow
@pytest.mark.serving
def test_vllm_serves_gemma_3_operator_and_plain_exports_token_for_token(tmp_path, tiny_tokenizer, text_files):
    """A tiny Gemma 3 (sliding window of 8 tokens, post-norms) fitted and distilled by `fit`: its ghost folder and
    its ghost student's (operators + LoRA, merged) through vLLM's Transformers backend and the folder's modelling
    file; its pruned folder and its magnitude student's (the scale folded into the post-norm gains, the norms
    trained) through vLLM's own Gemma 3 model; each token for token as transformers."""
    why = _has_vllm()
    if why:
        pytest.skip(why)
    model_dir = tmp_path / "tiny_gemma"
    tiny_model(GEMMA).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    run = tmp_path / "run"
    recovery = [{"name": "ghost"}, {"name": "magnitude", "method": "magnitude"}]
    students = [
        {"name": "ghost_lora_ft", "method": "ghost", "train": ["operators", "lora"]},
        {"name": "magnitude_norms_ft", "method": "magnitude", "train": ["operators", "norms"]},
    ]
    distill = ["--trainer.max_steps", "3", "--model.distill.students", json.dumps(students)]
    distill += ["--model.distill.lr", "1e-2", "--model.distill.lora.lr", "1e-2", "--model.distill.norm_lr", "1e-2"]
    distill += ["--model.distill.keep", "last", "--model.evaluation.analysis", "false"]
    fit = tiny_run_args(model_dir, text_files, run, *distill, recovery=recovery)
    done = subprocess.run([sys.executable, "-m", "ghostdistill", *fit], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "serving.json"
    check = [
        sys.executable, str(ROOT / "scripts" / "check_serving.py"), str(run), "--views", "pruned", "ghost",
        "ghost_lora_ft", "magnitude_norms_ft", "--dir", str(tmp_path / "served"), "--stacks", "transformers", "vllm",
        "--vllm-python", str(VLLM_PYTHON), "--new", "12", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    kinds = {view: r["kind"] for view, r in report["views"].items()}
    assert kinds == {
        "pruned": "plain",
        "ghost": "operators",
        "ghost_lora_ft": "operators",
        "magnitude_norms_ft": "plain",
    }
    ppl = {
        v: next(iter(r["metrics"].values()))["ppl"]
        for v, r in json.loads((run / "results.json").read_text())["views"].items()
    }
    for student, closed_form in (("ghost_lora_ft", "ghost"), ("magnitude_norms_ft", "magnitude")):
        assert ppl[student] != ppl[closed_form], f"{student} did not move off {closed_form}'s closed form"
    for view, r in report["views"].items():
        assert r["transformers"]["same_tokens_as_run"], f"{view}: the exported folder's tokens differ from the run's"
        assert r["vllm"]["same_tokens"], f"{view}: vLLM's greedy tokens differ from transformers'"
        assert r["vllm"]["within_tolerance"], (view, r["vllm"]["ppl"], r["transformers"]["ppl"])


@pytest.mark.serving
def test_a_w4a16_folder_this_cpu_build_cannot_run_is_named_before_loading(tmp_path):
    """vLLM's CPU wheel loads the extension of the CPU's instruction set; the AVX2 one has no `cpu_gemm_wna16`,
    so a W4A16 folder would load and its engine die in the first forward (`EngineDeadError`, the cause only in
    the worker's log). `vllm_check.missing_kernel` asks the loaded extension first: a weight-only int4 folder
    gets the reason exactly where the kernel is missing, and an int8 (W8A8) or unquantized folder never does."""
    why = _has_vllm()
    if why:
        pytest.skip(why)
    int4 = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}
    int8 = {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "dynamic": True}}
    for name, group in (("w4a16", int4), ("w8a8", int8), ("plain", None)):
        config = {"quantization_config": {"config_groups": {"group_0": group}}} if group else {}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    probe = (
        "import importlib.util, json, sys, torch; spec = importlib.util.spec_from_file_location('c', sys.argv[1]); "
        "vllm_check = importlib.util.module_from_spec(spec); spec.loader.exec_module(vllm_check); "
        "import vllm._custom_ops; has = hasattr(torch.ops._C, 'cpu_gemm_wna16') or torch.cuda.is_available(); "
        "print(json.dumps({'has': has, **{n: vllm_check.missing_kernel(sys.argv[2] + '/' + n) "
        "for n in ('w4a16', 'w8a8', 'plain')}}))"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", probe, str(ROOT / "scripts" / "serving" / "vllm_check.py"), str(tmp_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["w8a8"] is None and out["plain"] is None, out
    if out["has"]:
        assert out["w4a16"] is None, out
    else:
        assert "cpu_gemm_wna16" in out["w4a16"] and "W4A16" in out["w4a16"], out


FAKE_VLLM = """
import atexit, json, os, time
from pathlib import Path
from types import SimpleNamespace

__version__ = "fake"
here = Path(__file__).parent
plan = json.loads((here / "plan.json").read_text())
calls = here / "calls.txt"
attempt = calls.read_text().count("start") + 1 if calls.is_file() else 1
calls.open("a").write("start\\n")
if os.fork() == 0:  # an engine process that outlives its parent and holds its output open
    time.sleep(600)
    os._exit(0)
if attempt <= plan["abort_after"]:
    atexit.register(os.abort)  # in the teardown, after every result is written


class LLM:
    def __init__(self, model, **kwargs):
        self.view = Path(model).name
        calls.open("a").write(self.view + "\\n")
        if attempt <= plan["abort_at"].get(self.view, 0):
            os.abort()  # what vLLM's engine did: `terminate called without an active exception`

    def generate(self, prompts, params, use_tqdm=False):
        logprobs = [[None] + [{t: SimpleNamespace(logprob=-1.0)} for t in p[1:]] for p in prompts]
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[len(self.view)])], prompt_logprobs=lp)
                for lp in logprobs]


def SamplingParams(**kwargs):
    return SimpleNamespace(**kwargs)


def TokensPrompt(prompt_token_ids):
    return prompt_token_ids
"""


@pytest.fixture(scope="module")
def tiny_served_run(tiny_dir, text_files, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("vllm_abort") / "run"
    fit = tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false", samples=4)
    done = subprocess.run([sys.executable, "-m", "ghostdistill", *fit], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def _check_with_fake_vllm(run: Path, tmp_path: Path, abort_at: dict, abort_after: int = 0):
    """`scripts/check_serving.py` on `run`'s pruned and ghost views, its vLLM stage the real
    `scripts/serving/vllm_check.py` under a `python` whose `vllm` is a fake that aborts as `abort_at` ({view: on
    attempts up to}) and `abort_after` (attempts that abort once the file is complete) say; (the finished process,
    the report or None, the views each attempt loaded)."""
    fake = tmp_path / "fake"
    fake.mkdir(parents=True)
    (fake / "plan.json").write_text(json.dumps({"abort_at": abort_at, "abort_after": abort_after}))
    (fake / "vllm.py").write_text(FAKE_VLLM)
    python = fake / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{fake}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "serving.json"
    check = [
        sys.executable, str(ROOT / "scripts" / "check_serving.py"), str(run), "--views", "pruned", "ghost",
        "--dir", str(tmp_path / "served"), "--stacks", "transformers", "vllm", "--vllm-python", str(python),
        "--new", "2", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(check, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    calls = (fake / "calls.txt").read_text().split("start")[1:]
    return done, json.loads(out.read_text()) if out.is_file() else None, [c.split() for c in calls]


@pytest.mark.slow  # three runs of the check, each loading the run and reloading its folders in fresh processes
def test_a_vllm_process_that_aborts_keeps_what_it_measured_and_serves_the_rest_once_more(tiny_served_run, tmp_path):
    """vLLM's CPU engine once aborted a CI run between views (`terminate called without an active exception`).
    `check_serving.py` keeps the views the process finished, serves only the others in a second process, and says
    so; a process that aborts in its teardown after writing every result counts as done; a view that aborts its
    process twice, or a first view that does, fails the check with the exit code. An engine process left
    behind (each fake one sleeps 10 minutes) neither keeps the check waiting nor outlives it."""
    started = time.monotonic()
    done, report, calls = _check_with_fake_vllm(tiny_served_run, tmp_path / "once", {"ghost": 1}, abort_after=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert {v: r["vllm"]["tokens"] for v, r in report["views"].items()} == {"pruned": [[6]] * 4, "ghost": [[5]] * 4}
    assert calls == [["pruned", "ghost"], ["ghost"]]  # `pruned` was not served again
    assert "after ['pruned']: once more for ['ghost']" in done.stderr
    assert "after writing every result" in done.stderr  # the second process aborted in its teardown

    for name, abort_at in (("twice", {"ghost": 2}), ("first", {"pruned": 1})):
        done, _, _ = _check_with_fake_vllm(tiny_served_run, tmp_path / name, abort_at)
        assert done.returncode != 0 and "vLLM failed (exit code -6)" in done.stderr, (name, done.stderr[-3000:])
    assert time.monotonic() - started < 600, "a left-behind engine process kept the check waiting"  # not a speed test
