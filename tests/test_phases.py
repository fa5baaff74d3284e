"""A whole run driven through the run object (`pipeline.run.Run`) from plain Python, without a Lightning
Trainer (what a script or a notebook does), on the tiny LLaMA: setup, plan, calibrate, fit, evaluate,
analyse, report, distil a few steps, validate, export and reload. The training-free numbers equal those
`fit` writes for the same settings, and every phase reaches the observers and results.json."""

from __future__ import annotations

import json

import torch
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.core.model import ModelConfig
from ghostdistill.data import TextSource
from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData
from ghostdistill.distill.config import DistillConfig
from ghostdistill.distill.optim import make_optimizer
from ghostdistill.export import load_exported
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.config import RunConfig
from ghostdistill.pipeline.run import PhaseObserver, Run
from ghostdistill.pipeline.train import BestSteps, validate
from ghostdistill.planning import PlanConfig


def test_the_phases_run_without_a_trainer_and_match_fit(tiny_dir, text_files, tmp_path):
    cfg = RunConfig(
        model=ModelConfig(source=str(tiny_dir)),
        plan=PlanConfig(layers=[2, 3], num_layers=None),
        recovery=[RecoveryConfig(name="ghost"), RecoveryConfig(name="linearpatch", method="linearpatch")],
        distill=DistillConfig(methods=["ghost"], lr=1e-2),
        data=DataConfig(
            calibration=CalibrationData(
                source=TextSource(source=str(text_files["jsonl_gz"])), num_samples=16, seq_len=32
            ),
            evaluation=EvaluationData(
                sources=[TextSource(source=str(text_files["txt"]), name="held_out")], seq_len=32, max_windows=2
            ),
        ),
    )
    seen: list[tuple[str, str]] = []

    class Seen(PhaseObserver):
        def start(self, name, run):
            seen.append(("start", name))

        def on_phase(self, name, seconds, peak_bytes, run, **info):
            assert seconds >= 0 and (peak_bytes is None or peak_bytes > 0)
            seen.append(("end", name))

    run = Run(cfg, observers=[Seen()], log=lambda m: None)
    run.setup(tmp_path / "phases")
    llm, data = run.llm, run.data

    # plan, calibrate, fit: every method's operators
    run.calibrate()
    cal_pruned = run.pruned
    assert cal_pruned.plan.removed == (2, 3) and set(cal_pruned.views) >= {"dense", "pruned", "ghost", "linearpatch"}

    # evaluate every view, analyse, write the report
    views = ["dense", "pruned", "ghost", "linearpatch"]
    run.evaluate()
    run.analyse()
    run.write_report()
    written = json.loads((tmp_path / "phases" / "results.json").read_text())
    assert list(written["views"]) == views
    ends = [name for kind, name in seen if kind == "end"]
    assert ends == ["load", "setup", "plan", "calibrate", "fit", "evaluate", "analyse", "report"], ends
    assert set(written["phases"]) == {"load", "setup", "plan", "calibrate", "fit", "evaluate", "analyse"}
    assert written["calibration"]["fingerprint"] == run.key

    # the same settings through `fit` give the same numbers
    main(
        tiny_run_args(
            tiny_dir,
            text_files,
            tmp_path / "fit",
            recovery=[{"name": "ghost"}, {"name": "linearpatch", "method": "linearpatch"}],
        )
    )
    fitted = json.loads((tmp_path / "fit" / "results.json").read_text())
    for view in views:
        ours, theirs = written["views"][view]["metrics"]["held_out"], fitted["views"][view]["metrics"]["held_out"]
        assert ours["tokens"] == theirs["tokens"]
        for key in ("ppl", "kl", "top1"):
            if key in theirs:
                assert abs(ours[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (view, key, ours, theirs)

    # distil a few steps in a plain loop: the student improves on the batch it trains on, the teacher is untouched
    teacher_before = {k: v.clone() for k, v in llm.state_dict().items() if "lora" not in k}
    students = run.build_students()
    optimizer, scheduler = make_optimizer(students.params, cfg.distill, total_steps=6)
    held_out = data.eval_ids(cfg.data.evaluation.sources[0])
    tracker = BestSteps()
    tracker.record(validate(students, held_out, 2, step=0), students)
    batch = data.calibration_batches()[0]
    losses = []
    for step in range(1, 7):
        loss = run.distill_step(batch)["ghost_ft"]
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        tracker.record(validate(students, held_out, 2, step=step), students)
    assert losses[-1] < losses[0], losses
    assert [h["step"] for h in tracker.history] == list(range(7))
    after = llm.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in teacher_before.items())

    # export the fine-tuned view and reload it: the same logits as the in-memory view
    run.tracker = tracker
    run.end_distillation(6)
    (folder,) = run.export(["ghost_ft"], tmp_path / "export")
    assert seen[-1] == ("end", "export")
    reloaded = load_exported(folder).eval()
    ids = held_out[:1]
    with torch.no_grad(), cal_pruned.use("ghost_ft") as model:
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
