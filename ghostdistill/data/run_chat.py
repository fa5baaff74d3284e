"""Chat sources in a run (`data.chat`, `data.answers`): their windows, and the chat score's source; `data` is
the run's `data.run.RunData`.

The chat score. For held-out instructions (`data/README.md`: written for this project, none of them a
calibration instruction) the dense model writes its greedy answer, up to N tokens (`chat.max_new_tokens`,
64 by default). Every view is then run teacher-forced on instruction + dense answer, and scored on the answer
tokens only (the positions that predict them): KL(dense ‖ view) per token, top-1 agreement with the dense
model, and `prefix`: per instruction, how many answer tokens the view's own greedy answer shares with the dense
one before they first differ (the run of top-1 agreements from the answer's start: until the first
disagreement the view's greedy answer has the dense answer as its context, so it is that prefix), averaged
over the instructions. Perplexity there is that of the dense model's answers. It is deterministic (greedy, no
sampling) and costs one dense generation per run and one teacher-forced pass per view over
48 × (prompt + ≤ 64) tokens.

It is on by default (`data.evaluation.chat` null) for a model whose tokenizer has a chat template, as the
source ``{name: chat, source: generate, chat: {}}`` after the configured ones; `chat: false` leaves it out,
`chat: true` asks for it (an error without a chat template). A configured chat evaluation source replaces it.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from .answers import ChatWindows, generated_chat_windows, score_windows
from .chat import check_chat_template, conversations, given_windows
from .sources import GENERATE, ChatSettings, TextSource

CHAT_SCORE = "chat"


def chat_windows(data, src: TextSource, seq_len: int, n: int, seed: int, cache: Path | None):
    """(ids, answers) of a chat source for calibration or training (`data`: the run's `RunData`): given
    conversations packed, or with ``source: generate`` the dense model's answers (kept in `cache`)."""
    check_chat_template(data.tokenizer, src.label)
    if src.source != GENERATE:
        return given_windows(data.tokenizer, src, seq_len, n, seed)
    return data.made_by_dense(
        cache,
        lambda model, keep: generated_chat_windows(model, data.tokenizer, src, seq_len, n, seed, keep=keep),
        to_file=lambda out: {"input_ids": out[0], "answers": out[1]},
        from_file=lambda saved: (saved["input_ids"], saved["answers"]),
    )


def score_source(data, src: TextSource, cache: Path | None = None) -> ChatWindows:
    """The chat score's sequences of `src`: its instructions and the dense model's greedy answers, kept in
    `cache` (and, while they are written, batch by batch beside it: an interrupted run resumes)."""
    check_chat_template(data.tokenizer, src.label)
    return data.made_by_dense(
        cache,
        lambda model, keep: score_windows(model, data.tokenizer, src, keep=keep),
        needs="the chat score needs the dense model's answers, and this run did not provide the model",
        to_file=asdict,
        from_file=lambda saved: ChatWindows(**saved),
    )


def check_chat_sources(data, distilling: bool) -> None:
    """Every chat source of the run (calibration, training when distilling, evaluation) has the tokenizer's
    chat template, and its records read (a malformed line is named by file and line), before any work."""
    evaluation = data.eval_sources
    for src in (data.cfg.calibration.source, data.cfg.train.source if distilling else None, *evaluation):
        if src is not None and src.chat is not None:
            check_chat_template(data.tokenizer, src.label)
            conversations(src, for_eval=any(src is e for e in evaluation))


def statistics_masks(src: TextSource, answers: torch.Tensor | None) -> torch.Tensor | None:
    """The calibration windows' statistics mask (`calibration.stream`): None (every real token) unless the
    source is a chat source with ``chat.tokens: answers``: then the assistant's tokens and each window's first
    position."""
    if src.chat is None or src.chat.tokens != "answers":
        return None
    out = answers.clone()
    out[:, 0] = 1
    return out


def evaluation_sources(sources: list[TextSource], chat: bool | None, tokenizer) -> list[TextSource]:
    """`sources`, and after them the chat score's default source when `chat` (``data.evaluation.chat``) asks
    for it: null, when the tokenizer has a chat template and no source is a chat source already."""
    asked = chat or (chat is None and getattr(tokenizer, "chat_template", None))
    if not asked or any(s.chat is not None for s in sources):
        return list(sources)
    check_chat_template(tokenizer, "data.evaluation.chat")
    if CHAT_SCORE in [s.label for s in sources]:
        raise ValueError(
            f"data.evaluation.chat: the chat score's source is named {CHAT_SCORE!r}, and an evaluation source "
            "already has that name: rename it (`name:`) or set data.evaluation.chat false"
        )
    return [*sources, TextSource(name=CHAT_SCORE, source=GENERATE, chat=ChatSettings())]
