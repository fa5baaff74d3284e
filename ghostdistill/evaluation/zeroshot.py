"""Zero-shot accuracy of an in-memory causal LM through lm-evaluation-harness.

:func:`evaluate_zeroshot` scores the model object it is given (pruned, with forward hooks, mid-training...) on
multiple-choice tasks, the way lm-eval's ``simple_evaluate`` does with ``num_fewshot=0``, and returns a compact
``{task: {"acc", "acc_stderr", "acc_norm", "n"}, "average": {...}}`` summary.

Two sources of task data:

* online (``data_dir=None``): task names go to lm-eval's own registry, which downloads the datasets from the hub;
* offline (``data_dir=...``): the tasks in :data:`OFFLINE_TASKS` are read from a local folder holding the
  datasets' published files (layout of ``shared/data/README.md``) by the task definitions in
  :mod:`ghostdistill.evaluation.tasks`, which copy lm-eval's prompts and metrics.

lm-eval is an optional dependency (``pip install 'ghostdistill[zeroshot]'``): this module imports it only when it
scores or builds tasks, and :func:`require_lm_eval` says what to install when it is missing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.offload import model_device
from .tasks import TASKS_DIR
from .tasks import loaders as _loaders
from .zeroshot_scores import ZeroShotResults, average_scores, task_limits
from .zeroshot_scores import as_list as _as_list
from .zeroshot_scores import summarize as _summarize

if TYPE_CHECKING:
    import transformers
    from lm_eval.tasks import TaskManager

__all__ = [
    "OFFLINE_TASKS",
    "PAPER_TASKS",
    "ZeroShotResults",
    "average_scores",
    "check_offline_tasks",
    "evaluate_zeroshot",
    "offline_task_name",
    "require_lm_eval",
    "task_limits",
]

#: The zero-shot suite of the layer-pruning papers we compare with.
PAPER_TASKS: tuple[str, ...] = (
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "winogrande",
    "boolq",
    "openbookqa",
    "rte",
    "copa",
    "race",
)

#: Tasks that can be read from a local data folder (``data_dir``).
OFFLINE_TASKS: tuple[str, ...] = tuple(_loaders.TASK_FILES)

#: lm-eval warnings that are expected here and say nothing about the run.
_NOISE: tuple[str, ...] = (
    # We pass a model object on purpose: that is the point of this module.
    "`pretrained` model kwarg is not of type `str`",
    "Passed an already-initialized model through `pretrained`",
    # Emitted once per custom_dataset task; data_dir is passed as metadata.
    "Custom kwargs can be passed to `--metadata`",
    # We ask for zero-shot explicitly; registry tasks have no default to "overwrite".
    "Overwriting default num_fewshot",
)


def require_lm_eval() -> None:
    """Raise ImportError naming the install command (the ``zeroshot`` extra) when lm-evaluation-harness is
    missing (zero-shot evaluation needs it; nothing else does). Cheap: it finds the package without importing it."""
    found = False
    with contextlib.suppress(ImportError, ValueError):  # a broken or spec-less lm_eval entry in sys.modules
        found = importlib.util.find_spec("lm_eval") is not None
    if not found:
        raise ImportError(
            "zero-shot evaluation (evaluation.zeroshot) needs lm-evaluation-harness, which is not installed: "
            "pip install 'ghostdistill[zeroshot]'",  # the `zeroshot` extra of pyproject.toml
            name="lm_eval",
        )


def offline_task_name(task: str) -> str:
    """The lm-eval name of the offline definition of ``task`` (e.g. ``ghostdistill_piqa``)."""
    return _loaders.TASK_PREFIX + task


def check_offline_tasks(tasks: Sequence[str], data_dir: str | os.PathLike[str]) -> None:
    """Fail early when a task has no offline definition (the paper's rte, copa and race have none) or
    its files are missing from `data_dir`; the error names the task and lists the valid ones."""
    tasks = _as_list(tasks)
    unknown = [t for t in tasks if t not in OFFLINE_TASKS]
    if unknown:
        raise ValueError(
            f"task(s) {', '.join(map(repr, unknown))} cannot be read from a data folder; "
            f"valid offline tasks: {', '.join(OFFLINE_TASKS)} (set zeroshot.tasks to those, or data_dir: null "
            "for lm-eval's hub datasets)"
        )
    for task in tasks:
        _loaders.check_files(task, data_dir)  # FileNotFoundError naming task and path


@functools.cache
def _registry() -> TaskManager:
    # Indexing lm-eval's ~15k task YAMLs takes tens of seconds; do it once per process.
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _not_noise(record: logging.LogRecord) -> bool:
    return not any(noise in record.getMessage() for noise in _NOISE)


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    # Filters on a logger only see records created on that very logger, so the
    # filter goes on every lm_eval.* logger that exists once lm-eval is imported.
    loggers = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.split(".")[0] == "lm_eval"]
    for lg in loggers:
        lg.addFilter(_not_noise)  # a callable is a filter (logging accepts one since Python 3.2)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_not_noise)


@contextlib.contextmanager
def _preserve_state(model: transformers.PreTrainedModel) -> Iterator[None]:
    # HFLM calls model.eval() and simple_evaluate reseeds python/numpy/torch
    # global RNGs; evaluation in the middle of training must change neither.
    import numpy as np
    import torch

    modes = [(m, m.training) for m in model.modules()]
    py_state, np_state = random.getstate(), np.random.get_state()
    device = model_device(model)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        for module, training in modes:
            module.training = training


def evaluate_zeroshot(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    tasks: Sequence[str] = PAPER_TASKS,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
) -> ZeroShotResults:
    """Zero-shot accuracy of ``model`` (the object itself, hooks and all) on ``tasks``.

    Args:
        model: causal LM to score; it is wrapped, never reloaded or copied, so forward hooks and in-place
            surgery stay in effect. Its train/eval modes and the global RNG states are restored afterwards.
        tokenizer: its tokenizer (lm-eval may set a missing pad token on it).
        tasks: plain task names. Online: any lm-eval registry task, group or tag; offline: of :data:`OFFLINE_TASKS`.
        data_dir: folder with the published data files (``shared/data`` layout); ``None``: lm-eval's registry and
            the Hugging Face hub.
        limit: score only the first ``limit`` documents of each task.
        batch_size: lm-eval batch size.
        log_samples: keep lm-eval's per-document records (``result.samples``).

    Returns:
        ``{task: {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr" (those the task has), "n"}, ...,
        "average": {"acc", "acc_norm"}}`` (the papers' average: `average_scores`), lm-eval's output as ``.raw``.

    Raises:
        ValueError: an unknown task name (the message lists the valid ones).
        FileNotFoundError: offline, a task's data file is missing (names task and path).
        ImportError: lm-eval is not installed (the message names the ``zeroshot`` extra).
    """
    names = _as_list(tasks)
    # Validate before importing lm-eval's model code or touching the model.
    if data_dir is not None:
        check_offline_tasks(names, data_dir)
    require_lm_eval()
    if data_dir is None:
        manager, lm_eval_names = _registry(), names
        unknown = [t for t in names if t not in manager.all_tasks]
        if unknown:
            raise ValueError(
                f"task(s) {', '.join(map(repr, unknown))} not in lm-eval's task registry "
                f"(e.g. the paper's tasks: {', '.join(PAPER_TASKS)}; `lm-eval ls tasks` lists all); "
                f"tasks readable from a data folder: {', '.join(OFFLINE_TASKS)}"
            )
    else:
        from lm_eval.tasks import TaskManager

        # Only our folder: the offline run must not fall back on a hub task, and skipping lm-eval's own index saves
        # its start-up time. Task metadata is handed to each custom_dataset loader: how data_dir reaches it.
        manager = TaskManager(
            include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(Path(data_dir).resolve())}
        )
        lm_eval_names = [offline_task_name(t) for t in names]

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    with _quiet_lm_eval(), _preserve_state(model):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        raw = lm_eval.simple_evaluate(
            model=lm,
            tasks=lm_eval_names,
            num_fewshot=0,
            limit=limit,
            batch_size=batch_size,
            log_samples=log_samples,
            task_manager=manager,
        )
    raw = _from_rank_zero(raw)
    if raw is None:
        raise RuntimeError("lm-eval returned no results")
    return _summarize(raw, names)


def _from_rank_zero(raw: dict | None) -> dict | None:
    """lm-eval's results on every rank of a distributed run (DDP, FSDP2).

    Handed a model object, lm-eval takes itself for one process (rank 0 of 1): every rank scores every request
    in the same order and batches, which is what a sharded model needs (each forward is collective). But
    `simple_evaluate` builds its results only where the environment's LOCAL_RANK is 0 and returns None
    elsewhere; rank 0's results are then everyone's (the same numbers, computed alike)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return raw
    box = [raw if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
