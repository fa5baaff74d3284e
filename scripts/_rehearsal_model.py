"""The rehearsals' model and text (`scripts/rehearsal_8b.py`, `scripts/rehearsal_offload.py`,
`scripts/device_check.py`): a small tokenizer trained on the shipped excerpts, a random-weight LLaMA folder of a
shape (its config, its parameters by part), whether a folder already holds that model, the evaluation source,
and `scripts/reload_check.py`'s inputs."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from _rehearsal import C4_HEAD, WIKITEXT_HEAD


def c4_texts() -> list[str]:
    with gzip.open(C4_HEAD, "rt") as f:
        return [json.loads(line)["text"] for line in f]


def small_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE trained on the shipped excerpts (a second or two): a 128k-vocabulary tokenizer cannot
    be trained quickly, and the model's ids past this tokenizer simply never appear in text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*c4_texts(), WIKITEXT_HEAD.read_text()], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def model_config(shape: dict, num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**shape, "num_hidden_layers": num_layers}, bos_token_id=0, eos_token_id=1)


def parameter_count(shape: dict, num_layers: int) -> dict:
    """Parameters of a LLaMA of this shape, by part (the arithmetic docs/gpu.md uses)."""
    c, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = c // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    block = 2 * c * c + 2 * c * kv + 3 * c * f + 2 * c
    embed = v * c
    head = 0 if shape["tie_word_embeddings"] else v * c
    return {"block": block, "embed": embed, "head": head, "total": embed + head + num_layers * block + c}


def build_model_dir(folder: Path, shape: dict, num_layers: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """A random-weight LLaMA of `shape` and `num_layers` blocks saved with a small tokenizer in `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    start = time.perf_counter()
    tok = small_tokenizer()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape, num_layers), dtype=getattr(torch, dtype))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    return {"params": params, "build_s": round(time.perf_counter() - start, 2), "tokenizer_vocab": len(tok)}


EVAL_SOURCE = {"name": "wikitext2", "source": str(WIKITEXT_HEAD), "join": ""}


def same_model(folder: Path, shape: dict, num_layers: int) -> bool:
    """Whether `folder` holds a complete model of this shape (built by an earlier call), to be reused."""
    config = folder / "config.json"
    if not config.is_file() or not (folder / "tokenizer.json").is_file():
        return False
    saved = json.loads(config.read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return saved.get("num_hidden_layers") == num_layers and all(saved.get(k) == shape[k] for k in keys)


def reload_inputs(
    model_dir: Path, seq_len: int, windows: int, dtype: str, path: Path, new: int = 8, batch_size: int | None = 2
) -> None:
    """scripts/reload_check.py's inputs: four left-padded prompts, `new` tokens to generate (each forward of a
    folder bigger than the page cache reads it from the disk again), the run's evaluation windows (cut as `fit`
    cuts them) in batches of `batch_size` (None: one batch)."""
    import torch
    from transformers import AutoTokenizer

    from ghostdistill.data import TextSource, evaluation_windows

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    prompts = ["The capital of France is", "In 1969, the first", "A model", "Once upon a time"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    ids = evaluation_windows(tok, TextSource(**EVAL_SOURCE), seq_len, windows)
    inputs = {"ids": enc["input_ids"], "mask": enc["attention_mask"], "new": new, "windows": ids}
    torch.save(inputs | {"batch_size": batch_size or len(ids), "dtype": getattr(torch, dtype)}, path)
