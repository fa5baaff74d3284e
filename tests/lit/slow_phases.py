"""Run `ghostdistill fit` with one phase slowed down and announced, for the signal tests.

    python tests/lit/slow_phases.py <phase> <fit arguments...>

Prints `PHASE <phase>` (flushed) when the phase starts, then keeps it busy in Python (as lm-eval, the
statistics loop and the training loop are) for `$SLOW_SECONDS` (default 60) before doing the real work,
so a test can send a signal while the run is inside that phase. Phases: calibration, fitting,
evaluation, zeroshot (lm-eval itself is replaced by a stand-in score: no task data is needed),
distillation, export (the end-of-fit export, inside its temporary folder); `export_command` runs
`ghostdistill export` (the remaining arguments) through the script's entry point, slowed as `export`.
"""

from __future__ import annotations

import os
import sys
import time

from ghostdistill.cli import main
from ghostdistill.lit import module
from ghostdistill.pipeline import calibrate as callbacks


def busy(phase: str) -> None:
    print(f"PHASE {phase}", flush=True)
    end = time.monotonic() + float(os.environ.get("SLOW_SECONDS", "60"))
    while time.monotonic() < end:
        sum(i * i for i in range(10_000))  # pure Python work, like lm-eval's request loop


def slow(phase: str) -> None:
    if phase == "calibration":
        real = callbacks.accumulate
        calls = {"n": 0}

        def accumulate(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:  # two batches done and checkpointed: the rerun resumes after them
                busy(phase)
            return real(*args, **kwargs)

        callbacks.accumulate = accumulate
    elif phase == "fitting":
        real_fit = callbacks.fit_methods
        callbacks.fit_methods = lambda *a, **k: (busy(phase), real_fit(*a, **k))[1]
    elif phase == "evaluation":
        real_step = module.GhostDistill.test_step
        module.GhostDistill.test_step = lambda self, *a, **k: (
            busy(phase),
            real_step(self, *a, **k),
        )[1]
    elif phase == "zeroshot":
        from ghostdistill.evaluation import zeroshot

        def evaluate(*args, **kwargs):
            busy(phase)
            return {"piqa": {"acc": 0.5, "n": 1}, "average": {"acc": 0.5}}

        zeroshot.evaluate_zeroshot = evaluate
    elif phase == "distillation":
        real_train = module.GhostDistill.training_step

        def training_step(self, batch, batch_idx):
            if self.global_step == 2:  # after the checkpoint of step 2
                busy(phase)
            return real_train(self, batch, batch_idx)

        module.GhostDistill.training_step = training_step
    elif phase == "export":
        from ghostdistill.export import writer

        real_save = writer._save_weights

        def save_weights(*args, **kwargs):
            busy(phase)  # the temporary folder exists, half-filled
            return real_save(*args, **kwargs)

        writer._save_weights = save_weights
    else:
        raise SystemExit(f"unknown phase {phase!r}")


if __name__ == "__main__":
    if sys.argv[1] == "export_command":
        # `ghostdistill export <run> ...` as the installed script runs it (`entry`), slowed like `export`.
        from ghostdistill.cli import entry

        slow("export")
        sys.argv = ["ghostdistill", *sys.argv[2:]]
        entry()
    else:
        slow(sys.argv[1])
        main(sys.argv[2:])
