"""The phases of a run, each a plain typed function callable without a Lightning Trainer.

In the order `python -m ghostdistill fit` runs them:

1. `config.RunConfig.validate`            every check the values alone decide, before anything loads
2. `data.RunData`                         the calibration, training, validation and evaluation windows
3. `calibrate.calibrate`                  `choose` the plan → `collect_statistics` (one dense pass,
                                          resumable through `state`) → `fit` every method's gaps
4. `train.build_students`                 the `<method>_ft` students from their closed forms (distillation)
5. `train.distill_step`, `train.validate` one step of every student on one teacher pass; held-out KL
6. `evaluate.evaluate` (`score_views`, `ViewTally`)   perplexity, KL and top-1 of every view
7. `evaluate.zeroshot`, `evaluate.analysis`       lm-eval accuracy; operator anatomy and alignment
8. `reporting.write_report(RunReport)`    results.json, results.md and the plots
9. `export.export_views` / `export.export_run`    Hugging Face folders, from memory or a run folder

The Lightning layer (`ghostdistill.lit`) calls the same functions from its hooks and owns the loop,
the devices and the checkpoints; `tests/test_phases.py` runs them end to end without it.
"""
