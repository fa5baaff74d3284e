"""Readers that turn the published offline files into lm-eval documents.

Each ``load_<task>`` function is an lm-eval ``custom_dataset`` callable: lm-eval calls it with the task's
``metadata`` (where ``evaluate_zeroshot`` puts ``data_dir``) and gets back a ``datasets.DatasetDict``. The
documents use the field names of the Hugging Face datasets that lm-eval's own task YAMLs read, so the YAMLs
next to this file copy lm-eval's prompts verbatim and offline scores are comparable with online ones.

lm-eval imports this file by path (``!function loaders.<name>``), outside the ``ghostdistill`` package, so it
must stay self-contained: no relative imports.
"""

from __future__ import annotations

import bz2
import functools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets

#: Prefix of the lm-eval task names defined here: they neither shadow nor are shadowed by lm-eval's own.
TASK_PREFIX = "ghostdistill_"

#: Files each offline task reads, relative to the data folder (``shared/data/README.md``: as published).
TASK_FILES: dict[str, tuple[str, ...]] = {
    "arc_easy": ("arc_easy/ARC-Easy-Dev.jsonl",),
    "arc_challenge": ("arc_challenge/ARC-Challenge-Dev.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "winogrande": ("winogrande/dev.jsonl",),
    "boolq": ("boolq/dev.jsonl",),
    "openbookqa": ("openbookqa/test.jsonl",),
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
}

#: Split each task's documents are published under in the DatasetDict: the split lm-eval evaluates where the
#: published file is that split (ARC's file is the dev split; lm-eval scores ARC's test split).
TASK_SPLIT: dict[str, str] = {**dict.fromkeys(TASK_FILES, "validation"), "openbookqa": "test"}


def check_files(task: str, data_dir: str | os.PathLike[str]) -> list[Path]:
    """Return the files ``task`` (an offline task: `zeroshot.check_offline_tasks`) reads under ``data_dir``,
    raising ``FileNotFoundError`` for the first missing one."""
    paths = [Path(data_dir) / rel for rel in TASK_FILES[task]]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"offline task {task!r}: data file not found: {path} "
                f"(expected the published file at <data_dir>/{path.relative_to(data_dir)})"
            )
    return paths


def _lines(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as fh:
        return [line.strip() for line in fh if line.strip()]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _lines(path)]


def _arc_style(paths: list[Path], stem_key: str) -> list[dict[str, Any]]:
    # ARC and OpenBookQA publish choices as a list of {text, label}; lm-eval's hub copies as {"text", "label"} lists.
    return [
        {
            "id": row["id"],
            stem_key: row["question"]["stem"],
            "choices": {key: [c[key] for c in row["question"]["choices"]] for key in ("text", "label")},
            "answerKey": row["answerKey"],
        }
        for row in _jsonl(paths[0])
    ]


def _piqa(paths: list[Path]) -> list[dict[str, Any]]:
    rows, labels = _jsonl(paths[0]), _lines(paths[1])
    if len(rows) != len(labels):
        raise ValueError(f"piqa: {paths[0]} has {len(rows)} items but {paths[1]} has {len(labels)} labels")
    return [
        {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)} for r, lab in zip(rows, labels)
    ]


def _winogrande(paths: list[Path]) -> list[dict[str, Any]]:
    rows = _jsonl(paths[0])
    if any("answer" not in r for r in rows):
        # Some releases keep the answers only in the companion labels file.
        labels = _lines(paths[0].with_name(paths[0].stem + "-labels.lst"))
        rows = [{**r, "answer": lab} for r, lab in zip(rows, labels, strict=True)]
    return [{k: r[k] for k in ("sentence", "option1", "option2")} | {"answer": str(r["answer"])} for r in rows]


def _boolq(paths: list[Path]) -> list[dict[str, Any]]:
    # super_glue/boolq (what lm-eval reads) has label 0 = False, 1 = True.
    return [
        {"question": r["question"], "passage": r["passage"], "label": int(bool(r["answer"]))} for r in _jsonl(paths[0])
    ]


# lm-eval builds the HellaSwag query as ``label + ": " + ctx_a + " " + ctx_b.capitalize()``. The llama.cpp file
# keeps ctx_b (the unfinished last sentence of ActivityNet items, lower-cased in the source data) as published,
# e.g. "... on a roof. he". Capitalising a lower-case final fragment restores lm-eval's query; WikiHow items end
# in a full, capitalised sentence and are left alone.
_SENTENCE_END = re.compile(r"[.!?]\s+")


def _hellaswag_query(line: str) -> str:
    label, sep, ctx = line.partition(": ")
    if not sep:
        return line.strip()
    starts = [m.end() for m in _SENTENCE_END.finditer(ctx)]
    cut = starts[-1] if starts else 0
    tail = ctx[cut:]
    if tail[:1].islower() and not tail.rstrip().endswith((".", "!", "?")):
        ctx = ctx[:cut] + tail[0].upper() + tail[1:]
    return f"{label}: {ctx}".strip()


def _hellaswag(paths: list[Path]) -> list[dict[str, Any]]:
    with bz2.open(paths[0], "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    while lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(
            f"hellaswag: {paths[0]} has {len(lines)} lines, not a multiple of 6 "
            "(context, gold index, four endings per item)"
        )
    docs = []
    for i in range(0, len(lines), 6):
        ctx, gold, *endings = lines[i : i + 6]
        docs.append(
            {
                "activity_label": ctx.partition(": ")[0],
                "ctx": ctx,
                "query": _hellaswag_query(ctx),
                "choices": [e.strip() for e in endings],
                "label": gold.strip(),
                "gold": int(gold),
            }
        )
    return docs


_READERS: dict[str, Callable[[list[Path]], list[dict[str, Any]]]] = {
    "arc_easy": functools.partial(_arc_style, stem_key="question"),
    "arc_challenge": functools.partial(_arc_style, stem_key="question"),
    "hellaswag": _hellaswag,
    "winogrande": _winogrande,
    "boolq": _boolq,
    "openbookqa": functools.partial(_arc_style, stem_key="question_stem"),
    "piqa": _piqa,
}


def read_docs(task: str, data_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read ``task``'s published files into lm-eval documents (hub field layout)."""
    return _READERS[task](check_files(task, data_dir))


def _loader(task: str) -> Callable[..., datasets.DatasetDict]:
    def load(data_dir: str | os.PathLike[str] | None = None, **_: Any) -> datasets.DatasetDict:
        # lm-eval passes every metadata key (version, config_source, ...); only data_dir matters.
        if data_dir is None:
            raise ValueError(
                f"offline task {TASK_PREFIX}{task} needs a data folder: pass data_dir to "
                "evaluate_zeroshot (or metadata={'data_dir': ...} to lm-eval's TaskManager)"
            )
        import datasets  # here, so that listing tasks and checking files stays cheap

        # from_list keeps everything in memory: nothing is written to the HF cache.
        return datasets.DatasetDict({TASK_SPLIT[task]: datasets.Dataset.from_list(read_docs(task, data_dir))})

    load.__name__ = f"load_{task}"
    load.__doc__ = f"lm-eval ``custom_dataset`` for {TASK_PREFIX}{task}."
    return load


load_arc_easy = _loader("arc_easy")
load_arc_challenge = _loader("arc_challenge")
load_hellaswag = _loader("hellaswag")
load_winogrande = _loader("winogrande")
load_boolq = _loader("boolq")
load_openbookqa = _loader("openbookqa")
load_piqa = _loader("piqa")


# Winogrande's "partial evaluation": the choices are the sentence up to the blank filled with each option, the
# continuation is the rest of the sentence (copied from lm_eval/tasks/winogrande/preprocess_winogrande.py).
def winogrande_doc_to_text(doc: dict[str, Any]) -> int:
    """Index of the gold context (lm-eval's multiple-input convention)."""
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc: dict[str, Any]) -> str:
    """The sentence after the blank, scored after each filled-in context."""
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc: dict[str, Any]) -> list[str]:
    """The sentence up to the blank, filled with each option."""
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]
