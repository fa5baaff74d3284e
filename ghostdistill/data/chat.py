"""Conversations through the tokenizer's chat template: chat calibration, and the chat score's prompts.

A chat source is a `TextSource` with `chat` set (`ChatSettings`). Its records are conversations, lists of
messages ``{"role": "system" | "user" | "assistant", "content": ...}`` (ShareGPT's ``{"from": "system" |
"human" | "gpt", "value": ...}`` reads the same) under `chat.messages_field` of each record, from

- a local file: JSON lines, a JSON array (either optionally .gz) or parquet;
- a Hugging Face dataset, by hub id (with `chat.subset` and `split`) or a dataset folder (`datasets.load_dataset`);
- records in memory (`TextSource.records`: conversations handed over from Python);
- ``source: generate``: instructions the dense model answers itself (`data.answers`), data-free as
  ``generate`` is for plain text: the shipped set (`prompts/`, data/README.md) or `chat.instructions`.

Rendering. A conversation's tokens are the template's text tokenized without added special tokens (what
`apply_chat_template(tokenize=True)` gives). The assistant's tokens are found from the template itself: an
assistant message adds the text between the rendering of the messages before it with the generation prompt
and the rendering up to and including it; the tokens whose characters start there are marked (the fast
tokenizer's offsets). A template that does not render a conversation prefix by prefix (one that rewrites
earlier turns) gives no mask, which only `chat.tokens: answers` needs.

Packing (calibration and training windows). Conversations in a seeded order fill windows of `seq_len`
tokens one after another; every window starts where a conversation starts (as every chat starts at position
0 with the template's first token) and the conversation that does not fit is cut at the window's end. No
padding: every window is full, so the statistics see num_samples × seq_len tokens, as with plain text.

Masks (`chat.tokens`). ``all``: every token counts for the statistics (system and user turns are
activations the model sees). ``answers``: the assistant's tokens only, plus each window's first position,
whose tokens the first-position rule fits on their own (and `rotation_anchored`'s direction needs).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .sources import GENERATE, ChatSettings, TextSource, json_records

PROMPTS = Path(__file__).resolve().parent / "prompts"
#: Data-free chat calibration's instructions: PIQA's how-to questions (data/README.md).
CALIBRATION_PROMPTS = PROMPTS / "calibration.jsonl.gz"
#: The chat score's held-out instructions, written for this project (data/README.md).
HELDOUT_PROMPTS = PROMPTS / "heldout.jsonl"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}

Messages = list[dict[str, str]]


def check_chat_template(tokenizer, where: str) -> None:
    """A chat source needs the tokenizer's chat template: a one-line error before any work when it has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where} is a chat source, but the tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} "
            "has no chat template: use a text source (a file or a hub name) or a model with a chat template"
        )


def parse_messages(record, field: str, where: str) -> Messages:
    """One record's messages as ``[{"role", "content"}]``; a bad record is a one-line error naming `where`."""
    messages = record.get(field) if isinstance(record, dict) else record
    if not isinstance(messages, list) or not messages:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{where}: no conversation under {field!r} (found {found}); each record needs a non-empty list of "
            "messages {role, content} (set chat.messages_field to the field that holds them)"
        )
    out = []
    for k, m in enumerate(messages):
        role = m.get("role", m.get("from")) if isinstance(m, dict) else None
        content = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(
                f"{where}: message {k} is {json.dumps(m)[:80]}; each message needs a role ({', '.join(ROLES)}) "
                "and a text content"
            )
        out.append({"role": ROLES[role], "content": content})
    return out


def read_records(path: Path) -> list[tuple[str, object]]:
    """(where, record) of a local JSON-lines / JSON / parquet file; a bad line names the file and line."""
    if ".parquet" in path.suffixes:
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow's errors read alike
            raise ValueError(f"chat source file {path} cannot be read as parquet ({err})") from None
        return [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    return json_records(path, "conversations")


def conversations(src: TextSource, *, for_eval: bool) -> list[Messages]:
    """The conversations of a chat source (`src`: a `TextSource` with `chat`), after its first/max document
    selection. With ``source: generate`` and for evaluation, each ends with its last user message: the dense
    model writes the answer."""
    chat: ChatSettings = src.chat
    if src.records is not None:
        raw = [(f"{src.label} record {i}", r) for i, r in enumerate(src.records)]
    elif src.source == GENERATE:
        default = HELDOUT_PROMPTS if for_eval else CALIBRATION_PROMPTS
        raw = read_records(Path(chat.instructions).expanduser() if chat.instructions else default)
    elif Path(src.source).expanduser().is_file():
        raw = read_records(Path(src.source).expanduser())
    else:  # a Hugging Face dataset: a hub id or a dataset folder
        from datasets import load_dataset

        split = src.split or ("test" if for_eval else "train")
        rows = load_dataset(src.source, chat.subset, split=split)
        raw = [(f"{src.source} ({split}) row {i}", r) for i, r in enumerate(rows)]
    stop = None if src.max_documents is None else src.first_document + src.max_documents
    raw = raw[src.first_document : stop]
    if not raw:
        raise ValueError(f"chat source {src.label!r} has no conversations after first_document={src.first_document}")
    out = [parse_messages(r, chat.messages_field, where) for where, r in raw]
    if src.source == GENERATE or for_eval:
        out = [prompt_of(m, where) for m, (where, _) in zip(out, raw)]
    return out


def prompt_of(messages: Messages, where: str) -> Messages:
    """The messages up to and including the last user message (what the dense model answers)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise ValueError(f"{where}: no user message to answer; an instruction needs a user turn")
    return messages[: last + 1]


def render_text(tokenizer, messages: Messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode_prompt(tokenizer, messages: Messages) -> list[int]:
    """The tokens of `messages` with the template's generation prompt: what the model answers from."""
    return tokenizer(render_text(tokenizer, messages, True), add_special_tokens=False).input_ids


def encode(tokenizer, messages: Messages) -> tuple[list[int], list[int] | None]:
    """(ids, answers) of one conversation: its tokens and 1 for each assistant token (None: the template does
    not render the conversation prefix by prefix; see the module docstring)."""
    text = render_text(tokenizer, messages)
    spans, ok = [], True
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], True) if i else ""
        upto = render_text(tokenizer, messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            ok = False
            break
        spans.append((len(before), len(upto)))
    if not getattr(tokenizer, "is_fast", False):
        # No character offsets: only a conversation without answers has a known mask.
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return ids, [0] * len(ids) if ok and not spans else None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if not ok:
        return enc.input_ids, None
    return enc.input_ids, [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offset_mapping]


def pack(items: Iterable[tuple[list[int], list[int]]], seq_len: int, num_samples: int, label: str, more: str = ""):
    """Windows [num_samples, seq_len] of ids and of their mask, from `items` (ids, mask) in order (see Packing)."""
    ids, mask, window, window_mask = [], [], [], []
    for conv_ids, conv_mask in items:
        take = seq_len - len(window)
        window += conv_ids[:take]
        window_mask += conv_mask[:take]
        if len(window) == seq_len:
            ids.append(window)
            mask.append(window_mask)
            window, window_mask = [], []
            if len(ids) == num_samples:
                return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    raise ValueError(
        f"{label}: its conversations fill only {len(ids)} windows of {seq_len} tokens, {num_samples} requested; "
        f"use more conversations{more}, fewer num_samples or a shorter seq_len"
    )


def given_windows(
    tokenizer, src: TextSource, seq_len: int, num_samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration (or training) windows of a chat source's given conversations, in a seeded order, and their
    assistant mask (zeros where the template gives none: see `encode`)."""
    convs = conversations(src, for_eval=False)
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)

    def items() -> Iterator[tuple[list[int], list[int]]]:
        for i in order:
            ids, answers = encode(tokenizer, convs[i])
            if answers is None and src.chat.tokens == "answers":
                raise ValueError(
                    f"{src.label}: chat.tokens answers needs the assistant's tokens, and the chat template of "
                    f"{getattr(tokenizer, 'name_or_path', '')!r} does not render conversations prefix by prefix "
                    "(or its tokenizer gives no offsets): use chat.tokens all"
                )
            yield ids, answers if answers is not None else [0] * len(ids)

    return pack(items(), seq_len, num_samples, src.label)
