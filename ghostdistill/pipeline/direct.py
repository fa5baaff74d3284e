"""A run of a typed `RunConfig` from Python, without a Trainer: `run_training_free` calls the phases `fit`
runs with `trainer.max_steps: 0`, in one process, and returns the `Run` (its views in `run.pruned`, its
results in `run.report`):

    load → setup → plan → calibrate → fit [→ evaluate → zero-shot → analyse → report]

It is what the Python API (`ghostdistill.api`: `repair`, `plan`, `evaluate`) runs, and the entry for code
that builds a `RunConfig` and runs it directly instead of through `fit`'s arguments. Its numbers are `fit`'s:
evaluation in one process is what the Lightning test loop does batch by batch (`tests/test_phases.py`).
Distillation needs the Lightning loop: `lit.trainer.fit_run` runs a `Run` through the Trainer `fit` uses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .run import Run


def fit_device(accelerator: str | None = "auto") -> str:
    """The device a single-process `fit` with `trainer.accelerator` `accelerator` runs on: the GPU for
    ``auto`` (or None), ``gpu`` and ``cuda`` when torch sees one, the CPU otherwise. What a training-free run
    outside the Trainer is put on (the `frontier`'s pass, the Python API's model loaded by name)."""
    return "cuda" if str(accelerator or "auto") in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


def run_training_free(
    run: Run, run_dir: Path | None = None, *, device: str | torch.device | None = None, evaluate: bool = True
) -> Run:
    """Run `run` (a `Run` of a typed `RunConfig`: `Run(cfg)`, or with a model object already loaded)
    training-free, as the module docstring says, and return it. `run_dir`: the run folder (statistics resume
    from it, results are written there); None keeps everything in memory. `device`: where the model runs (None:
    where it is). `evaluate`: score every view (then zero-shot, the analyses and the report, as the config
    asks); without it the run ends after the fit."""
    llm = run.load()
    if device is not None:
        llm.to(device)
    run.setup(run_dir)
    run.calibrate()
    if evaluate:
        run.evaluate()
        run.zeroshot()
        run.analyse()
        run.write_report()
    return run
