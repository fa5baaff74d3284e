"""lm-eval task definitions that read the offline data folder.

The YAML files here are lm-eval 0.4 task configs (``TaskManager(include_path=TASKS_DIR)``);
their documents come from :mod:`ghostdistill.evaluation.tasks.loaders` through ``custom_dataset``,
with the data folder passed as task metadata ``data_dir``.
"""

from pathlib import Path

#: Folder holding the offline task YAMLs; give it to ``lm_eval.tasks.TaskManager(include_path=...)``.
TASKS_DIR: Path = Path(__file__).resolve().parent
