"""Token windows: random calibration windows, non-overlapping evaluation (and training) windows, and
self-generated text."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import torch

from ..core.io import Resumable
from ..core.offload import model_device
from .sources import TextSource, load_documents


def evaluation_windows(tokenizer, src: TextSource, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows over the joined documents (the usual perplexity protocol)."""
    docs = load_documents(src, for_eval=True)
    # Longer than model_max_length is fine (transformers warns once): we cut windows ourselves.
    ids = tokenizer(src.join.join(docs)).input_ids
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"{src.label}: {len(ids)} tokens is fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def calibration_windows(tokenizer, src: TextSource, seq_len: int, num_samples: int, seed: int) -> torch.Tensor:
    """`num_samples` random windows of `seq_len` tokens, deterministic for a seed.

    A window comes from one document long enough to hold it (random document, random offset, as GPTQ
    and the pruning papers sample C4); if too few documents are long enough, the rest come from the
    short documents joined into one stream, then from further random offsets of the long ones.
    """
    docs = load_documents(src, for_eval=False)
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    windows: list[list[int]] = []
    short: list[int] = []
    long: list[list[int]] = []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for i in order:
        if len(windows) == num_samples:
            break
        ids = tokenizer(docs[i]).input_ids
        if len(ids) >= seq_len:
            start = rng.randint(0, len(ids) - seq_len)
            windows.append(ids[start : start + seq_len])
            long.append(ids)
        else:
            short.extend(ids + eos)
    while len(windows) < num_samples and len(short) >= seq_len:
        start = rng.randint(0, len(short) - seq_len)
        windows.append(short[start : start + seq_len])
    # Few but long documents (one book, one raw file): more windows at other random offsets of them.
    while len(windows) < num_samples and long:
        ids = long[rng.randrange(len(long))]
        start = rng.randint(0, len(ids) - seq_len)
        windows.append(ids[start : start + seq_len])
    if len(windows) < num_samples:
        raise ValueError(
            f"{src.label}: only {len(windows)} windows of {seq_len} tokens available, {num_samples} requested; "
            "use more documents or a shorter seq_len"
        )
    return torch.tensor(windows, dtype=torch.long)


def disjoint_windows(tokenizer, sources: TextSource | list[TextSource], seq_len: int, num_samples: int) -> torch.Tensor:
    """The first `num_samples` non-overlapping windows of `seq_len` tokens of each source's documents joined in
    order, EOS between them (as `calibration_windows` joins short ones), the sources one after another (no
    window spans two): every token of the text at most once."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    sources = [sources] if isinstance(sources, TextSource) else sources
    windows: list[list[int]] = []
    for src in sources:
        ids: list[int] = []
        want = (num_samples - len(windows)) * seq_len
        for doc in load_documents(src, for_eval=False):
            if len(ids) >= want:
                break
            ids.extend(tokenizer(doc).input_ids + eos)
        windows += [ids[i : i + seq_len] for i in range(0, min(len(ids), want) - seq_len + 1, seq_len)]
        if len(windows) == num_samples:
            return torch.tensor(windows, dtype=torch.long)
    names = " + ".join(s.label for s in sources)
    raise ValueError(
        f"{names}: the text holds {len(windows)} disjoint windows of {seq_len} tokens, {num_samples} requested; "
        "use more documents or sources, a shorter seq_len, or cut: random"
    )


@torch.no_grad()
def generate_windows(
    model,
    tokenizer,
    seq_len: int,
    num_samples: int,
    seed: int,
    batch_size: int = 8,
    progress: bool | Callable[[Iterable, str], Iterable] = True,
    keep: Resumable | None = None,
    what: str = "calibration",
) -> torch.Tensor:
    """Data-free calibration (or training, `what`) text: the dense model samples its own text from the start token.

    Plain ancestral sampling (temperature 1, no top-k/top-p) so the windows follow the model's own
    distribution; EOS is suppressed so every window is full length. `progress`: a bar (tqdm's, or a run's
    `(items, desc)` wrapper) or none. `keep`: each batch kept as it is made, with the sampler's state after
    it, so that a pass cut short resumes with the next batch and samples what it would have.
    """
    from tqdm.auto import tqdm

    bar = progress if callable(progress) else lambda items, desc: tqdm(items, desc=desc, disable=not progress)

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise ValueError(
            f"data-free calibration ('generate') starts every sample from the BOS (or EOS) token, and the tokenizer "
            f"{type(tokenizer).__name__} has neither: use a text calibration source (a file or a hub name)"
        )
    # No sequence finishes early (EOS suppressed by min_new_tokens), so padding is never used; generate
    # still wants an id when the tokenizer defines none.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else start
    device = model_device(model)
    keep = keep if keep is not None else Resumable(None)
    sizes = [min(batch_size, num_samples - lo) for lo in range(0, num_samples, batch_size)]
    if [tuple(b.shape) for b in keep.items] != [(n, seq_len) for n in sizes[: len(keep.items)]]:
        keep.items, keep.state = [], None  # not this pass's batches: made again
    out = list(keep.items)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if keep.state is not None:
            set_rng_state(keep.state, device)
        for n in bar(sizes[len(out) :], f"generating {what} text"):
            prompt = torch.full((n, 1), start, dtype=torch.long, device=device)
            seqs = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=seq_len - 1,
                min_new_tokens=seq_len - 1,
                pad_token_id=pad,
            )
            out.append(seqs[:, :seq_len].cpu())
            keep.add(out[-1], rng_state(device))
    return torch.cat(out)


def rng_state(device: torch.device) -> dict:
    """The sampler's state: the CPU generator's, and the GPU's when `device` is one."""
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def shared_ngrams(windows: torch.Tensor, reference: torch.Tensor, n: int = 32) -> list[int]:
    """Indices of the rows of `windows` that share a run of `n` tokens with `reference`: the check that
    training or validation windows never overlap evaluation windows cut from the same text (a shared
    32-token run does not happen by chance in natural text). `reference` rows are consecutive windows of
    one text, so runs across their boundaries count too; `n` shrinks to half a window for short windows."""
    n = max(1, min(n, windows.shape[1] // 2 or 1))
    stream = reference.reshape(-1).tolist()
    seen = {hash(tuple(stream[i : i + n])) for i in range(len(stream) - n + 1)}
    rows = windows.tolist()
    return [
        k for k, row in enumerate(rows) if any(hash(tuple(row[i : i + n])) in seen for i in range(len(row) - n + 1))
    ]
