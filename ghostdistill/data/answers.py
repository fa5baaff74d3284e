"""The dense model's own answers to instructions: data-free chat calibration, and the chat score's references.

Both render each instruction with the tokenizer's chat template and its generation prompt (`data.chat`) and
let the dense model answer, `ANSWER_BATCH` prompts at a time (left-padded: each answer continues its own
prompt), until its end-of-turn token or `max_new_tokens`. An answer keeps the end-of-turn token it wrote. The
batch is fixed, not the run's `data.batch_size`: padding and the sampler's draws depend on how prompts are
batched, and the answers (so the calibration text and the chat score) must not depend on the run's batch size.

- Calibration (`generated_chat_windows`): instructions in a seeded order, answered greedily (by default) or
  by seeded sampling at `chat.temperature`; prompt and answer are one conversation, its answer tokens marked,
  and the conversations are packed into windows (`data.chat.pack`). More windows than the instructions fill
  take another seeded order of them when sampling (greedy answers would repeat: an error says so).
- The chat score (`score_windows`): every held-out instruction answered greedily; the sequences prompt +
  answer are right-padded, with the answer tokens marked. The answer is cut before the first token at which
  the dense model's own teacher-forced argmax (one forward over the whole sequence, what the score runs)
  differs from the token it generated (a float near-tie between the cached and the full forward; rare):
  so on every scored token the dense argmax is the dense answer's token, and a view's run of top-1
  agreements from the answer's start is exactly the prefix its own greedy answer shares with the dense one.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..core.head import final_hidden, output_head
from ..core.io import Resumable
from .chat import check_chat_template, conversations, encode_prompt, pack
from .windows import rng_state, set_rng_state

#: Prompts answered together (see the module docstring).
ANSWER_BATCH = 16


@dataclass
class ChatWindows:
    """The chat score's sequences: ids [n, L] right-padded, their attention mask, and 1 on answer tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    answers: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)


def stop_tokens(model: nn.Module, tokenizer) -> list[int]:
    """The ids that end an answer: the generation config's end-of-sequence ids and the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(
            "chat answers end at the end-of-sequence token, and neither the model nor its tokenizer has one"
        )
    return ids


@torch.no_grad()
def answer(
    model: nn.Module, prompts: list[list[int]], max_new_tokens: int, stop: list[int], pad: int, temperature: float = 0.0
) -> list[list[int]]:
    """Each prompt's answer (its new tokens up to and including the first stop token), all in one batch."""
    device = next(model.parameters()).device
    ids = pad_sequence([torch.tensor(p) for p in prompts], batch_first=True, padding_value=pad, padding_side="left")
    mask = pad_sequence([torch.ones(len(p), dtype=torch.long) for p in prompts], batch_first=True, padding_side="left")
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop,
        pad_token_id=pad,
        **({"do_sample": False} | sampling),
    )[:, ids.shape[1] :].tolist()
    return [row[: next((i + 1 for i, t in enumerate(row) if t in stop), len(row))] for row in out]


def _pad_id(tokenizer, stop: list[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]


def generated_chat_windows(
    model: nn.Module,
    tokenizer,
    src,
    seq_len: int,
    num_samples: int,
    seed: int,
    progress: bool = True,
    keep: Resumable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-free chat calibration: windows of instructions and the dense model's answers, and their answer
    mask; deterministic for `seed`. `keep`: each batch's answers kept as they come, with the sampler's state
    after them, so that a pass cut short answers from the next batch on what it would have."""
    from tqdm.auto import tqdm

    check_chat_template(tokenizer, src.label)
    chat = src.chat
    prompts = [encode_prompt(tokenizer, m) for m in conversations(src, for_eval=False)]
    temperature = 0.0 if chat.temperature is None else chat.temperature
    stop, rng = stop_tokens(model, tokenizer), random.Random(seed)
    pad = _pad_id(tokenizer, stop)
    device = next(model.parameters()).device
    bar = tqdm(desc="answering calibration instructions", unit=" answers", disable=not progress)
    keep = keep if keep is not None else Resumable(None)
    done = len(keep.items)  # batches answered before: replayed from `keep` in the same order

    def items() -> Iterator[tuple[list[int], list[int]]]:
        rounds, count = 0, 0
        while True:
            if rounds and not temperature:
                return  # greedy answers of the same instructions would repeat: `pack` says how many windows there are
            order = list(range(len(prompts)))
            rng.shuffle(order)
            for lo in range(0, len(order), ANSWER_BATCH):
                batch = [prompts[i] for i in order[lo : lo + ANSWER_BATCH]]
                if count < done and len(keep.items[count]) == len(batch):
                    answers = keep.items[count]
                else:
                    if count == done and keep.state is not None:
                        set_rng_state(keep.state, device)
                    answers = answer(model, batch, chat.answer_tokens("calibration"), stop, pad, temperature)
                    del keep.items[count:]
                    keep.add(answers, rng_state(device))
                count += 1
                bar.update(len(batch))
                for p, a in zip(batch, answers):
                    yield p + a, [0] * len(p) + [1] * len(a)
            rounds += 1

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        more = "" if temperature else " (or chat.temperature > 0: sampled answers, several per instruction)"
        ids, answers = pack(items(), seq_len, num_samples, src.label, more)
    bar.close()
    return ids, answers


@torch.no_grad()
def score_windows(
    model: nn.Module, tokenizer, src, progress: bool = True, keep: Resumable | None = None
) -> ChatWindows:
    """The chat score's sequences (module docstring). `keep`: each batch's answers kept as they come, so that a
    pass cut short answers from the next batch on."""
    from tqdm.auto import tqdm

    check_chat_template(tokenizer, src.label)
    prompts = [encode_prompt(tokenizer, m) for m in conversations(src, for_eval=True)]
    stop = stop_tokens(model, tokenizer)
    pad, n = _pad_id(tokenizer, stop), src.chat.answer_tokens("score")
    keep = keep if keep is not None else Resumable(None)
    seqs: list[tuple[list[int], list[int]]] = []
    for b, lo in enumerate(
        tqdm(range(0, len(prompts), ANSWER_BATCH), desc="the dense model's answers", disable=not progress)
    ):
        batch = prompts[lo : lo + ANSWER_BATCH]
        if b >= len(keep.items) or len(keep.items[b]) != len(batch):
            del keep.items[b:]
            keep.add(answer(model, batch, n, stop, pad))
        seqs += list(zip(batch, keep.items[b]))
    ids = pad_sequence([torch.tensor(p + a) for p, a in seqs], batch_first=True, padding_value=pad)
    mask = pad_sequence([torch.ones(len(p) + len(a), dtype=torch.long) for p, a in seqs], batch_first=True)
    answers = pad_sequence([torch.tensor([0] * len(p) + [1] * len(a)) for p, a in seqs], batch_first=True)
    windows = ChatWindows(ids, mask, answers)
    device, head = next(model.parameters()).device, output_head(model)
    for lo in range(0, len(windows), ANSWER_BATCH):
        rows = slice(lo, lo + ANSWER_BATCH)
        hidden = final_hidden(model, windows.input_ids[rows].to(device), windows.attention_mask[rows].to(device))
        scored = windows.answers[rows, 1:].bool()
        argmax = torch.zeros_like(scored, dtype=torch.long)
        argmax[scored] = head(hidden[:, :-1][scored.to(device)]).argmax(-1).cpu()
        differs = scored & (argmax != windows.input_ids[rows, 1:])
        for row in differs.nonzero()[:, 0].unique().tolist():
            first = int(differs[row].nonzero()[0]) + 1  # the first answer token the dense argmax does not reproduce
            windows.answers[lo + row, first:] = 0
    return windows
