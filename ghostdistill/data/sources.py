"""Text sources: where calibration and evaluation text comes from.

A source is a hub data set (wikitext2, c4, ptb: real `datasets` loading code, users have internet), a
local file (.txt/.raw, .jsonl, .json, either optionally .gz, or .parquet), or `generate`: the dense
model writes its own calibration text (data-free, seeded sampling). With `chat` set it is a chat source:
conversations through the tokenizer's chat template (`data.chat`), also from any Hugging Face dataset.
`records` holds a source's documents (or conversations) in memory, handed over from Python; `source` is
then only its name.

The hub sources load with every `datasets` from 3.0 on, none of them through a loading script (which
`datasets` 4 no longer runs): WikiText-2 (`Salesforce/wikitext`) is stored as parquet, C4 is read from
one named json.gz shard of `allenai/c4`, and PTB (`ptb-text-only/ptb_text_only`, a script data set)
from the hub's parquet conversion of it, the `refs/convert/parquet` revision (the rows its script made).
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

HUB_SOURCES = ("wikitext2", "c4", "ptb")
PTB_REPO = "ptb-text-only/ptb_text_only"
#: The hub's parquet conversion of a data set: a branch beside `main`, which `load_dataset` reads as plain
#: parquet files (`datasets` >= 4 does not run the loading script on `main`).
PARQUET_REVISION = "refs/convert/parquet"
GENERATE = "generate"
LOCAL_SUFFIXES = (".txt", ".raw", ".jsonl", ".json", ".parquet")
CHAT_SUFFIXES = (".jsonl", ".json", ".parquet")
TOKENS = ("all", "answers")
#: The longest answer the dense model writes when `chat.max_new_tokens` is null.
ANSWER_TOKENS = {"calibration": 256, "score": 64}


@dataclass
class ChatSettings:
    """A chat source's settings (`TextSource.chat`; ``chat: {}`` takes every default).

    Args:
        messages_field: the field of each record that holds its messages.
        subset: the Hugging Face dataset's configuration (hub sources).
        instructions: with ``source: generate``, a file of instructions the dense model answers; null: the
            shipped set (calibration: PIQA's how-to questions; evaluation: the held-out prompts).
        max_new_tokens: the longest answer the dense model writes; null: 256 for calibration, 64 for the score.
        temperature: calibration answers: 0 greedy, else seeded sampling at this temperature; null: 0, the
            answers a chat user most likely sees (a small model sampled at 1 drifts off topic). The score is
            always greedy.
        tokens: calibration only: the tokens the statistics sum over, ``all`` or ``answers`` (the module
            docstring).
    """

    messages_field: str = "messages"
    subset: str | None = None
    instructions: str | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    tokens: str = "all"

    def validate(self, where: str, *, for_eval: bool = False) -> None:
        if self.tokens not in TOKENS:
            raise ValueError(f"{where}.chat.tokens {self.tokens!r}: choose one of {', '.join(TOKENS)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"{where}.chat.max_new_tokens must be >= 1 (or null), got {self.max_new_tokens}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"{where}.chat.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if for_eval and (self.tokens != "all" or self.temperature is not None):
            raise ValueError(
                f"{where}.chat: tokens and temperature are calibration settings; the chat score scores the dense "
                "model's greedy answers: leave them out of an evaluation source"
            )
        if self.instructions is not None and not Path(self.instructions).expanduser().is_file():
            raise FileNotFoundError(f"{where}.chat.instructions file {self.instructions!r} does not exist")

    def answer_tokens(self, what: str) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else ANSWER_TOKENS[what]


@dataclass
class TextSource:
    """Where text comes from.

    Args:
        source: ``wikitext2``, ``c4`` or ``ptb`` (hub), ``generate`` (data-free), or a local file path.
        name: label used in results (defaults to the source name or file stem).
        split: hub split; defaults to ``train`` for calibration and ``test``/``validation`` for evaluation.
        text_field: field holding the text in json/jsonl/parquet records.
        first_document: skip this many documents (to keep calibration and evaluation disjoint).
        max_documents: use at most this many documents after `first_document`.
        join: separator placed between documents when they are concatenated for perplexity.
        chat: conversations through the tokenizer's chat template (`ChatSettings`; ``chat: {}`` for the
            defaults); null: plain text.
        records: the documents (or, with `chat`, the conversations) themselves, in memory; `source` is then
            only a name.
    """

    source: str = "wikitext2"
    name: str | None = None
    split: str | None = None
    text_field: str = "text"
    first_document: int = 0
    max_documents: int | None = None
    join: str = "\n\n"
    chat: ChatSettings | None = None
    records: list | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.source in HUB_SOURCES or self.source == GENERATE:
            return self.source
        return Path(self.source).name.split(".")[0]

    def describe(self) -> dict:
        out = {k: getattr(self, k) for k in ("source", "split", "first_document", "max_documents", "join")}
        if self.chat is not None:
            out["chat"] = asdict(self.chat)
        if self.records is not None:
            out["records"] = f"{len(self.records)} in memory"
        return out


def validate_source(src: TextSource, where: str = "data source", *, for_eval: bool = False) -> None:
    """What a source's values alone decide; `where` names it in errors (``data.calibration.source``)."""
    if src.first_document < 0 or (src.max_documents is not None and src.max_documents < 1):
        raise ValueError(
            f"first_document={src.first_document}, max_documents={src.max_documents}: "
            "first_document must be >= 0 and max_documents >= 1"
        )
    if src.records is not None and not src.records:
        raise ValueError(f"{where}: records is an empty list; give documents or conversations, or leave it null")
    path = Path(src.source).expanduser()
    if src.chat is not None:
        src.chat.validate(where, for_eval=for_eval)
        if src.records is not None or src.source == GENERATE or path.is_dir():
            return
        named = any(s in path.suffixes for s in (*CHAT_SUFFIXES, ".gz", ".txt", ".raw"))
        if path.is_file() and not any(s in path.suffixes for s in CHAT_SUFFIXES):
            raise ValueError(
                f"{where}: chat source file {src.source!r} must end in {', '.join(CHAT_SUFFIXES)} (optionally "
                ".gz): records of messages; a hub dataset id or a dataset folder also works"
            )
        if named and not path.is_file():
            raise FileNotFoundError(f"{where}: chat source file {src.source!r} does not exist")
        return
    if src.source in HUB_SOURCES or src.source == GENERATE or src.records is not None:
        return
    if not any(s in path.suffixes for s in LOCAL_SUFFIXES):
        raise ValueError(
            f"text source {src.source!r} is neither a hub name ({', '.join(HUB_SOURCES)}), {GENERATE!r}, "
            f"nor a file ending in {', '.join(LOCAL_SUFFIXES)} (optionally .gz)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"text source file {src.source!r} does not exist")


def load_documents(src: TextSource, *, for_eval: bool) -> list[str]:
    """The source's documents, in order, after the first/max document selection."""
    validate_source(src)
    if src.chat is not None:
        raise ValueError(f"{src.label} is a chat source: its conversations are read by data.chat")
    if src.source == GENERATE and src.records is None:
        raise ValueError("'generate' makes tokens with the model; use generate_windows()")
    if src.records is not None:
        docs = [str(d) for d in src.records]
    else:
        docs = _hub_documents(src, for_eval) if src.source in HUB_SOURCES else _file_documents(src)
    stop = None if src.max_documents is None else src.first_document + src.max_documents
    docs = docs[src.first_document : stop]
    if not docs:
        raise ValueError(f"text source {src.source!r} has no documents after first_document={src.first_document}")
    return docs


def read_text(path: Path) -> str:
    """The text of a file, gzip-compressed or not; a binary, truncated or corrupt one is a one-line error
    that names it."""
    gz = path.suffix == ".gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") if gz else open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"text source file {path} is not UTF-8 text (byte {err.start}{' after decompressing' if gz else ''}): "
            "give a text file (.txt/.raw, .jsonl, .json, optionally .gz) or a .parquet file"
        ) from None
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError; a truncated file, EOFError
        raise ValueError(
            f"text source file {path} cannot be read{' as gzip' if gz else ''} ({err or type(err).__name__}): "
            "it is truncated or corrupt; copy or download it again"
        ) from None


def json_records(path: Path, what: str) -> list[tuple[str, object]]:
    """(where, record) of a JSON-lines or JSON-array file (optionally .gz): a bad line names the file and line,
    a file of none says it holds no `what`."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            records = [(f"{path} item {i}", r) for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: its JSON array is not valid JSON ({err.msg}, line {err.lineno})") from None
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
    if not records:
        raise ValueError(f"{path} is empty: no {what}")
    return records


def _file_documents(src: TextSource) -> list[str]:
    path = Path(src.source).expanduser()
    if ".parquet" in path.suffixes:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=[src.text_field])
        except Exception as err:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError, KeyError) read alike
            raise ValueError(f"text source file {path} cannot be read as parquet ({err})") from None
        return [t for t in table.column(src.text_field).to_pylist() if t]
    if ".jsonl" in path.suffixes or ".json" in path.suffixes:
        records = [r for _, r in json_records(path, "JSON records")]
        if not any(isinstance(r, dict) and src.text_field in r for r in records):
            keys = sorted(records[0]) if isinstance(records[0], dict) else type(records[0]).__name__
            raise ValueError(
                f"{path}: records have no text field {src.text_field!r} (they have {keys}); set text_field"
            )
        docs = [r[src.text_field] for r in records if isinstance(r, dict) and r.get(src.text_field)]
        if not docs:
            raise ValueError(f"{path}: every record's {src.text_field!r} field is empty")
        return docs
    # A plain text file is one document (WikiText-2 raw keeps its article structure in the text).
    text = read_text(path)
    if not text.strip():
        raise ValueError(f"{path} is empty (no text)")
    return [text]


def _hub_documents(src: TextSource, for_eval: bool) -> list[str]:
    from datasets import load_dataset

    split = src.split or (("validation" if src.source == "c4" else "test") if for_eval else "train")
    if src.source == "wikitext2":
        rows = load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split=split)["text"]
        # The usual perplexity protocol joins the rows with "\n\n" into one document.
        return ["\n\n".join(rows)] if for_eval else [r for r in rows if r.strip()]
    if src.source == "c4":
        shard = (
            "en/c4-validation.00000-of-00008.json.gz" if split == "validation" else "en/c4-train.00000-of-01024.json.gz"
        )
        return load_dataset("allenai/c4", data_files={split: shard}, split=split)["text"]
    try:  # ptb, the one of HUB_SOURCES left (load_documents passes no other source)
        rows = load_dataset(PTB_REPO, revision=PARQUET_REVISION, split=split)["sentence"]
    except FileNotFoundError as err:  # datasets' DatasetNotFoundError: no such revision or split
        raise FileNotFoundError(
            f"ptb: the hub's parquet conversion of {PTB_REPO} ({PARQUET_REVISION}, split {split!r}) "
            f"cannot be loaded ({err}); give the PTB text as a local file source instead"
        ) from err
    return [" ".join(rows)] if for_eval else rows
