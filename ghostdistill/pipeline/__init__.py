"""The run (`run.Run`) and its phases, each a plain typed function callable without a Lightning Trainer.

`run.Run` is built from one complete, validated `config.RunConfig` (data included) and calls the phases
in the order `python -m ghostdistill fit` runs them, keeping the run's state (model, tokenizer, data,
views, students, report, fingerprint):

1. `Run.setup`      `core.model.load_model`, `planning.check_plan`, `data.run.RunData` (bound to the tokenizer
                    and the dense model), `RunData.check_before_calibration`
2. `Run.calibrate`  `calibrate.open_state` → `calibrate.calibrate`: plan (`planning.choose`) → calibrate
                    (`collect_statistics`, resumable through `calibration.state`) → fit (every method's gaps)
3. distil           `Run.build_students` (`train.build_students`), `Run.distill_step`
                    (`train.distill_step`), `Run.validate` (`train.validate`, `BestSteps`), `Run.end_distillation`
4. evaluate         `Run.start_evaluation` / `score_batch` (`evaluate.score_views`, `ViewTally`) /
                    `finish_evaluation` (`evaluate.view_results`), or `Run.evaluate` in one process
5. `Run.zeroshot`, `Run.analyse`  lm-eval accuracy; operator anatomy and alignment (`evaluate`)
6. `Run.write_report`  `reporting.write_report(RunReport)`: results.json, results.md and the plots
7. `Run.export`     `export.export_views` (`export.options.ExportOptions`); a finished run folder: `reload.load_run` / `reload.export_run`;
                    one view as a model in memory: `export.run_view_model`

`Run.prepare` runs 1-2 (and the students of 3) in their order, `Run.finish` 5-6; `Run(cfg).execute(run_dir)`
runs 1-6 training-free for a typed `RunConfig` (the Python API's runs); distillation goes through `fit`'s
Trainer (`lit.trainer.fit_run`).

Each phase's seconds and peak memory go to the run's `on_phase` observers (`run.observe`) and to
results.json's `phases`. The Lightning layer (`ghostdistill.lit`) calls the same phases from its hooks
and owns the loop, the devices and the checkpoints; `tests/test_phases.py` runs them without it.
"""
