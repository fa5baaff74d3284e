"""What the rehearsals (`scripts/rehearsal_8b.py`, `scripts/rehearsal_offload.py`) and the prepared GPU check
(`scripts/device_check.py`) share; it imports none of them.

The model's shapes (`LLAMA3_8B`, `TINY`) and builders (a small tokenizer trained on the shipped excerpts, a
random-weight folder), the phases of a step measured (`Phases`: seconds, peak RSS and RssAnon sampled by
`core.measure.SampledPeak`, peak GPU memory as a span of the process's `core.measure.PEAK`, the measurer of the
run's own phases) and marked by an observer of the run's phases (`fit_hooks`, `export_hooks`), and
`run_worker`: a step in a fresh process (`python scripts/rehearsal_8b.py worker ...`).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ghostdistill.core.measure import PEAK, SampledPeak, status_bytes

ROOT = Path(__file__).resolve().parents[1]
C4_HEAD = ROOT / "data" / "c4_validation_head100.jsonl.gz"
WIKITEXT_HEAD = ROOT / "data" / "wikitext2_test_head.raw"
GIB = 2**30

# Meta-Llama-3-8B's config.json, less the weights (and the depth, which callers set).
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
)
# The same family at a width that runs in seconds (still grouped-query, untied, a vocabulary past the tokenizer).
TINY = dict(
    LLAMA3_8B,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=3000,
    max_position_embeddings=512,
)


# ------------------------------------------------------------------------------------------------ memory


class Phases:
    """Seconds, peak RSS and RssAnon and (on a GPU) peak `torch.cuda.max_memory_allocated` per named phase.

    `enter(name)` closes the current phase and opens `name` (a phase entered again accumulates seconds and
    keeps its highest peaks); RSS and RssAnon are sampled every `interval` seconds. `mark_loaded(model)` takes
    the baseline the peaks are reported above: RSS with the model loaded (on a GPU: the memory allocated when
    the `load` phase ends, the model moved there)."""

    def __init__(self, cuda: bool = False, interval: float = 0.01) -> None:
        self.cuda = cuda
        self.records: dict[str, dict] = {}
        self.extra: dict = {}
        self.baseline_rss: int | None = None
        self.baseline_gpu: int | None = None
        self.start_rss = status_bytes("VmRSS")
        self._name = "startup"
        self._since = time.perf_counter()
        self._rss = SampledPeak(("VmRSS", "RssAnon"), interval)
        if cuda:
            import torch

            torch.cuda.init()  # so that `PEAK` measures the GPU
        self._gpu = PEAK.start() if cuda else None

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @property
    def current(self) -> str:
        return self._name

    def enter(self, name: str, _last: bool = False) -> None:
        self._sync()
        now = time.perf_counter()
        rss, anon = self._rss.close() if _last else self._rss.take()
        record = self.records.setdefault(self._name, {"seconds": 0.0, "peak_rss": 0, "peak_gpu": 0, "peak_rss_anon": 0})
        record["seconds"] += now - self._since
        record["peak_rss"] = max(record["peak_rss"], rss)
        record["peak_rss_anon"] = max(record["peak_rss_anon"], anon)
        if self.cuda:
            import torch

            if self._name == "load" and name != "load":
                # The model reaches the GPU at the end of `load` (loaded on the CPU, then moved).
                self.baseline_gpu = torch.cuda.memory_allocated()
            record["peak_gpu"] = max(record["peak_gpu"], PEAK.stop(self._gpu) or 0)
            self._gpu = None if _last else PEAK.start()
        self._name, self._since = name, now

    def mark_loaded(self, model=None) -> None:
        """The model is loaded: make its weights resident (`from_pretrained` maps safetensors files lazily, so
        RSS right after loading holds almost none of them) and take the baseline."""
        if model is not None:
            touch(model)
        self._sync()
        self.baseline_rss = status_bytes("VmRSS")
        if self.cuda:
            import torch

            self.baseline_gpu = torch.cuda.memory_allocated()

    def close(self) -> dict:
        """Stop sampling; the summary (GiB and seconds per phase)."""
        self.enter("end", _last=True)
        base = self.baseline_rss if self.baseline_rss is not None else self.start_rss
        out = {
            "start_rss_gib": round(self.start_rss / GIB, 3),
            "loaded_rss_gib": round(base / GIB, 3),
            "phases": {},
            **self.extra,
        }
        for name, r in self.records.items():
            if name == "end":
                continue
            row = {
                "seconds": round(r["seconds"], 2),
                "peak_rss_gib": round(r["peak_rss"] / GIB, 3),
                "peak_rss_above_model_gib": round((r["peak_rss"] - base) / GIB, 3),
                "peak_rss_anon": r["peak_rss_anon"],
            }
            if self.cuda:
                row["peak_gpu_gib"] = round(r["peak_gpu"] / GIB, 3)
                row["peak_gpu_above_model_gib"] = round((r["peak_gpu"] - (self.baseline_gpu or 0)) / GIB, 3)
            out["phases"][name] = row
        if self.cuda:
            out["loaded_gpu_gib"] = round((self.baseline_gpu or 0) / GIB, 3)
        return out


def touch(model) -> None:
    """Read one value per 4 kB page of every parameter and buffer of `model` (on the CPU), so that weights
    mapped from a file are resident."""
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.numel():
                t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()


# Which rehearsal phase each phase of the run (`ghostdistill.pipeline.run.Run`, reported to its observers)
# begins; the run's other phases (setup, plan, step, validate) stay in the phase they start in. `step` and
# `validate` are timed on their own: each optimizer step (seconds and tokens, for throughput) and each
# student validation (inside `distillation`).
FIT_PHASES = {
    "load": "load",
    "calibrate": "calibration",
    "fit": "fit",
    "distil": "distillation",
    "evaluate": "evaluation",
    "analyse": "analysis",
    "report": "report",
    "export": "export",
}
EXPORT_PHASES = {"load": "load", "export": "export"}

# What the installed observer collects (several runs in one process each install their own).
ACTIVE: dict = {"phases": None, "steps": [], "timings": {}}
_INSTALLED = contextlib.ExitStack()


class PhaseMarks:
    """A `Run` observer (`pipeline.run.PhaseObserver`) that marks the rehearsal's phases in `phases`:
    the run reports each of its phases, so nothing in the package is wrapped or replaced."""

    def __init__(self, phases: Phases, names: dict[str, str]) -> None:
        self.phases, self.names, self._clock = phases, names, 0.0

    def start(self, name: str, run) -> None:
        if name in self.names:
            self.phases.enter(self.names[name])
        elif name == "step":
            self.phases._sync()
            self._clock = time.perf_counter()

    def on_phase(self, name: str, seconds: float, peak_bytes, run, **info) -> None:
        if name == "load":
            self.phases.mark_loaded(run.llm)
        elif name == "step":
            self.phases._sync()
            step = {"step": int(info["step"]), "seconds": time.perf_counter() - self._clock, "tokens": info["tokens"]}
            ACTIVE["steps"].append(step)
        elif name == "validate":
            ACTIVE["timings"].setdefault("validate_s", []).append(round(seconds, 3))


def _observe(observer: PhaseMarks) -> None:
    from ghostdistill.pipeline.run import observe

    _INSTALLED.close()  # the previous run's observer
    _INSTALLED.enter_context(observe(observer))


def fit_hooks(phases: Phases) -> list[dict]:
    """Mark the phases of `fit` in `phases`; returns the list that collects one entry per optimizer step
    (seconds, synchronised on a GPU, and tokens), for throughput. `ACTIVE["timings"]` collects the seconds of
    each student validation."""
    ACTIVE.update(phases=phases, steps=[], timings={})
    _observe(PhaseMarks(phases, FIT_PHASES))
    return ACTIVE["steps"]


def export_hooks(phases: Phases) -> None:
    ACTIVE["phases"] = phases
    _observe(PhaseMarks(phases, EXPORT_PHASES))


# ---------------------------------------------------------------------------------------- model and text


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

# ------------------------------------------------------------------------------------------ the steps


def run_worker(kind: str, args: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> dict:
    """`rehearsal_8b.worker(kind, ...)` in a fresh process; its summary, with `returncode` and the tail of its output."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    start = time.perf_counter()
    with open(log, "a") as sink:
        sink.write(f"\n===== {kind}: {' '.join(args)}\n")
        sink.flush()
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "rehearsal_8b.py"), "worker", kind, str(out), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})},
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
    summary = json.loads(out.read_text()) if out.stat().st_size else {"ok": False}
    out.unlink()
    evict(log.parent)
    summary["returncode"] = done.returncode
    summary["wall_s"] = round(time.perf_counter() - start, 2)
    if done.returncode != 0:
        summary["ok"] = False
        summary["log_tail"] = log.read_text()[-4000:]
    return summary


def evict(folder: Path) -> None:
    """Drop the page cache of every file under `folder` (written, then fsynced): the model folder and the
    exported views are tens of GB, and their cached pages count against a shared machine's memory."""
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


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
