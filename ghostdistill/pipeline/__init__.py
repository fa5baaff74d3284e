"""The run (`run.Run`) and its phases, each a plain typed function callable without a Lightning Trainer.

`run.Run` is built from one complete, validated `config.RunConfig` (data included), keeps the run's state
(model, tokenizer, data, views, students, report, fingerprint) and calls the phases in the order
`python -m ghostdistill fit` runs them: its docstring lists them. The work of each phase is a module's:
`calibrate` (plan → statistics, resumable → every method's fit), `train` (the students, their steps, validation
and the budget curve), `evaluate` (scores, analyses, zero-shot), `export` (views in their formats; a finished
run folder rebuilt: `reload`). `phases` times each phase for the run's observers and results.json's `phases`;
who calls the phases, from Lightning's hooks or without a Trainer: `run`'s docstring.
"""
