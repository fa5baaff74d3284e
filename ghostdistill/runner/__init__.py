"""Runs of a `fit` config, below both top layers (`cli`, `api`): one, or several gathered into one report.

    fit.py      `fit`: the LightningCLI that parses a config (YAML, dotted overrides) and runs it (`run_fit`)
    config.py   a `fit` config as typed objects without a Trainer (`ParsedFit` and its `fit`, `parse_fit`)
    compare.py  `compare_plans`: one `fit` per plan of a compare file, gathered into compare.json/csv/md/png
    frontier.py `frontier_depths`: per depth, the training-free frontier (`pipeline.frontier`) and its
                students (one `fit` each), gathered into frontier.json/csv/md/png

The command line (`cli`) parses its arguments and calls these; the Python API (`ghostdistill.compare`,
`ghostdistill.frontier`) checks its arguments and calls the same functions, so both write the same files.
"""
