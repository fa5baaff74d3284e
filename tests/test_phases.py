"""The phases of a run called one after another from plain Python, without a Lightning Trainer (what a
script or a notebook does), on the tiny LLaMA: calibrate, evaluate, report, distil a few steps, validate,
export and reload. The training-free numbers equal those `fit` writes for the same settings."""

from __future__ import annotations

import json

import torch
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.core.model import ModelConfig, load_model, load_tokenizer
from ghostdistill.data import TextSource
from ghostdistill.distill.config import DistillConfig
from ghostdistill.distill.optim import make_optimizer
from ghostdistill.export import load_exported
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.calibrate import calibrate, calibration_summary
from ghostdistill.pipeline.config import RunConfig
from ghostdistill.pipeline.data import CalibrationData, DataConfig, EvaluationData, RunData
from ghostdistill.pipeline.evaluate import evaluate
from ghostdistill.pipeline.export import export_views
from ghostdistill.pipeline.train import BestSteps, build_students, distill_step, validate
from ghostdistill.planning import PlanConfig
from ghostdistill.reporting.report import RunReport
from ghostdistill.reporting.results import write_report


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
    cfg.validate()
    llm = load_model(cfg.model)
    data = RunData(cfg.data, load_tokenizer(cfg.model))
    report = RunReport(model={"source": cfg.model.source})

    # calibrate: plan, statistics, every method's operators
    cal = calibrate(llm, cfg.plan, cfg.recovery, data.calibration_batches(), log=lambda m: None)
    assert cal.plan.removed == (2, 3) and set(cal.pruned.views) >= {"dense", "pruned", "ghost", "linearpatch"}
    report.plan, report.recovery = cal.plan.to_dict(), cal.fits
    report.calibration = calibration_summary(cal, {}, "no-fingerprint", len(data.calibration_ids()))

    # evaluate every view, write the report
    windows = {s.label: data.eval_ids(s) for s in cfg.data.evaluation.sources}
    views = ["dense", "pruned", "ghost", "linearpatch"]
    report.views = evaluate(cal.pruned, views, windows, cfg.data.batch_size)
    write_report(tmp_path / "phases", report)
    written = json.loads((tmp_path / "phases" / "results.json").read_text())
    assert list(written["views"]) == views

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
    students = build_students(cal.pruned, cfg.distill, data.calibration_batches()[0])
    optimizer, scheduler = make_optimizer(students.params, cfg.distill, total_steps=6)
    held_out = windows["held_out"]
    tracker = BestSteps()
    tracker.record(validate(students, held_out, 2, step=0), students)
    batch = data.calibration_batches()[0]
    losses = []
    for step in range(1, 7):
        loss = distill_step(students, batch)["ghost_ft"]
        losses.append(float(loss))
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
    report.distill = tracker.summary(cfg.distill, 6, students.share_prefix)
    (folder,) = export_views(cal.pruned, data.tokenizer, report.to_dict(), cfg, ["ghost_ft"], tmp_path / "export")
    reloaded = load_exported(folder).eval()
    ids = held_out[:1]
    with torch.no_grad(), cal.pruned.use("ghost_ft") as model:
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
