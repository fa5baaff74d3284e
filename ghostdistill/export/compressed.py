"""Quantized checkpoints for vLLM: a view's folder compressed by llm-compressor (`oneshot`), in the
compressed-tensors format that vLLM loads as it is (`LLM(model=folder)`; the scheme is in `config.json`).

    export <run> --views rotation_anchored --format compressed-tensors --schemes W8A8 W4A16

writes ``<dir>/<view>.<scheme>/`` per view and scheme: ``W8A8``, ``W4A16``, ``W4A16-AWQ`` or ``W8A16`` (what each
quantizes, and how: `compressed_oneshot`).

**Calibration is the run's own.** GPTQ's Hessians (X·Xᵀ of each linear's input), SmoothQuant's and AWQ's
activation ranges come from the windows the repair was fitted on (`RunData.calibration_ids`: the same tokens,
the same order), given to `oneshot` as token ids. A quantized repair is then calibrated on exactly the hidden
states its operators or folded weights were solved for.

**Another environment.** llm-compressor cannot live beside ghostdistill and vLLM: each release pins one
compressed-tensors (0.14.0.1: ==0.19.0; vLLM 0.32: ==0.17.0) and a transformers range (0.14.0.1: <= 5.17.0;
ghostdistill: >= 5.19), and no release satisfies both. So ghostdistill writes the view's Hugging Face folder
and the calibration ids, and runs `compressed_oneshot.py` (self-contained: never imports ghostdistill) with the
Python of the environment that has llm-compressor: `--quantize-python`, else ``$GHOSTDISTILL_QUANTIZE_PYTHON``,
else ``.venv-quantize/bin/python`` (`bash scripts/setup.sh --quantize`), else this interpreter if it imports
llmcompressor. Without one, the export is refused before the run loads, naming the command that makes it.

**Which views.** Every view: plain and folded ones are the family's own architecture, which llm-compressor
quantizes linear by linear; a view with operators (ghost, LinearPatch, their students) is loaded with its
`modeling_ghostdistill.py` (remote code): its blocks' linears are quantized, its C×C gap operators stay in
float32 (parameters, not linears), and the calibration passes run the operators' hooks, so each block after a
gap is calibrated on the repaired stream. vLLM serves such a folder through its Transformers backend with the
quantized linears swapped for its own.

Each folder is written in a temporary folder beside the target and renamed into place (as `writer`); an
existing one is replaced only with `overwrite`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..core.checks import check_names
from ..core.lock import marked_tmpdir
from . import compressed_oneshot
from .quantize import CHECKOUT
from .writer import ViewExport, check_target, staged_folder, write_folder

FORMAT = "compressed-tensors"
SCHEMES = ("W8A8", "W4A16", "W4A16-AWQ", "W8A16")
DEFAULT_SCHEMES = ("W8A8", "W4A16")
PYTHON_ENV = "GHOSTDISTILL_QUANTIZE_PYTHON"
SETUP = "bash scripts/setup.sh --quantize"


def check_schemes(schemes: Iterable[str]) -> list[str]:
    return check_names("quantization scheme", schemes, SCHEMES)


def compressed_path(root: str | os.PathLike, view: str, scheme: str) -> Path:
    return Path(root) / f"{view}.{scheme}"


def targets(root: str | os.PathLike, views: Iterable[str], schemes: Sequence[str]) -> list[Path]:
    return [compressed_path(root, view, scheme) for view in views for scheme in schemes]


def _imports_llmcompressor(python: Path) -> bool:
    # Always asked in a process: a virtual environment's python is a link to the system's, so comparing resolved
    # paths cannot tell two environments apart.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llmcompressor') is None)"
    return subprocess.run([str(python), "-c", probe], capture_output=True, check=False).returncode == 0


def quantize_python(given: str | os.PathLike | None = None) -> Path:
    """The Python of an environment that imports llmcompressor (see the module docstring), checked before any
    work; a one-line error names the way to make one."""
    named = given or os.environ.get(PYTHON_ENV)
    if named:
        python = Path(named)
        if not python.is_file() or not _imports_llmcompressor(python):
            raise FileNotFoundError(
                f"{python} cannot import llmcompressor: run `{SETUP}` (makes .venv-quantize) or name the Python of an "
                "environment that has it"
            )
        return python
    for python in (Path(".venv-quantize/bin/python"), CHECKOUT / ".venv-quantize/bin/python"):
        if python.is_file() and _imports_llmcompressor(python):
            return python.absolute()
    if importlib.util.find_spec("llmcompressor") is not None:
        return Path(sys.executable)
    raise FileNotFoundError(
        f"writing {FORMAT} needs llm-compressor in its own environment: run `{SETUP}` (makes .venv-quantize), or pass "
        f"--quantize-python / set {PYTHON_ENV} to the Python of an environment that has it"
    )


def quantize_folder(python: Path, folder: Path, ids: Path, scheme: str, out: Path, failed_log: Path, log=print) -> None:
    """`compressed_oneshot.py` under `python` on one folder (its default group size: `compressed_oneshot`). On
    failure its output goes to `failed_log` and the error's last line into the message."""
    command = [str(python), compressed_oneshot.__file__, str(folder), str(ids), scheme, str(out)]
    # PYTHONPATH cleared: the other environment must not import this one's packages.
    env = {**os.environ, "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
    log(f"quantizing {folder.name} as {scheme} with llm-compressor ({python})")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        failed_log.write_text(done.stdout + done.stderr)
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llm-compressor failed on {folder.name} as {scheme}: {tail[0]} (its log: {failed_log})")


def write_compressed(
    view: ViewExport, root: Path, schemes: Sequence[str], python: Path, *, overwrite: bool = False, log=print
) -> list[Path]:
    """A prepared view (`writer.prepare`) quantized with each of `schemes` under `root`; returns the folders, in
    `schemes`' order. The view's float folder and the calibration ids (`view.calibration()`) are written once to a
    temporary folder beside the targets and removed at the end."""
    root = Path(root)
    paths = [compressed_path(root, view.view, s) for s in schemes]
    if not view.write:
        view.join()
        return paths
    for path in paths:
        check_target(path, "folder", overwrite, "overwrite (--overwrite / export.overwrite: true)")
    calibration_ids = view.calibration()
    # The float view and the calibration ids, once for every scheme, in a marked temporary folder (what a later
    # export of the view cleans up if this one is killed) that goes at the end.
    root.mkdir(parents=True, exist_ok=True)
    work = marked_tmpdir(root, f".{view.view}.tmp-{os.getpid()}-", view.view)
    try:
        source = write_folder(view, work / view.view)
        ids = work / "calibration_ids.pt"
        torch.save(calibration_ids.to(torch.long).cpu(), ids)
        for scheme, target in zip(schemes, paths):
            with staged_folder(target, f"export of view {view.view} as {scheme} to {target}") as out:
                quantize_folder(python, source, ids, scheme, out, target.with_name(f"{target.name}.log"), log)
                _provenance(out, source, scheme, calibration_ids.shape)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return paths


def _provenance(out: Path, source: Path, scheme: str, shape) -> None:
    """config.json's `ghostdistill` section (kept by save_pretrained) gains what quantized it; the model card
    comes along with a line saying so."""
    config = json.loads((out / "config.json").read_text())
    tool = json.loads((out / "oneshot.json").read_text())
    config.setdefault("ghostdistill", {})["quantization"] = {
        "format": FORMAT,
        **tool,
        "calibration": f"the run's calibration windows, {shape[0]} x {shape[1]} tokens",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "oneshot.json").unlink()
    card = (source / "README.md").read_text() if (source / "README.md").is_file() else ""
    note = (
        f"\n## Quantized\n\n{scheme} ({FORMAT}), written by llm-compressor {tool['llmcompressor']}'s `oneshot`, "
        f"calibrated on the run's calibration windows ({shape[0]} x {shape[1]} tokens). Serve with vLLM: "
        "`LLM(model=folder)`.\n"
    )
    (out / "README.md").write_text(card + note)
