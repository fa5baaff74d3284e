"""An 8B-width rehearsal on the CPU: LLaMA-3-8B's width with 4 blocks, random weights, through the real CLI.

The model has Meta-Llama-3-8B's shapes everywhere but depth (`hidden_size` 4096, 32 heads, 8 KV heads,
`intermediate_size` 14,336, `vocab_size` 128,256, rope θ 5e5, untied output head; 4 blocks instead of 32), so
what only the real width can break breaks here: the 4096 Hadamard matrix of LinearPatch, grouped-query shapes,
the untied head, the chunked head with 128k logits, dtype casts. Per `--dtype` (float32, then bfloat16 with
`--model.model.dtype bfloat16`, from the same float32 folder):

1. `fit` (configs/llama3_11.yaml with CPU overrides): explicit plan `--model.plan.layers [1]`, calibration on
   4 × 64 tokens of the shipped C4 excerpt, recovery ghost, ghost_paper (fit: plain), linearpatch (Hadamard
   at 4096), replaceme and magnitude, two distillation steps of ghost and linearpatch (`train: [operators]`),
   validation on one window, evaluation on 2 × 64 tokens of the shipped WikiText-2 excerpt (the config's
   third student, ghost_lora_ft with operators + LoRA, is left out: each of its two recipes has a run);
2. the same with `train: [lora]` (recovery ghost and linearpatch only);
3. `export <run> --views ghost ghost_ft linearpatch replaceme` of the first run, `ghost_ft` of the second
   (LoRA merged);
4. each exported folder reloaded in a fresh process without ghostdistill (`scripts/reload_check.py`): greedy
   generation, and its perplexity on the run's evaluation windows against the run's results.json.

Every step runs in its own process (`python scripts/rehearsal_8b.py worker ...`); a background thread samples
its RSS (psutil when installed, else /proc/self/status VmRSS) every 10 ms, and the phases are marked by an
observer of the run's phases (`PhaseMarks`, installed by `fit_hooks` and `export_hooks` through
`ghostdistill.pipeline.run.observe`). Printed: one JSON line per
dtype, with per phase (load, calibration, fit, distillation, distillation_lora, evaluation, export, reload)
the seconds and the peak RSS above the loaded model (RSS right after that process loaded its model, its
weights made resident: `from_pretrained` maps safetensors files lazily; for `load` itself the overshoot of
loading above the loaded model), plus the checks.

    .venv/bin/python scripts/rehearsal_8b.py --dtype float32 bfloat16 --dir /tmp/rehearsal_8b
    .venv/bin/python scripts/rehearsal_8b.py --dtype bfloat16 --windows 16 16 1 --dir /tmp/rehearsal_8b

(the second on a CPU without bfloat16 arithmetic, where a bfloat16 backward at the default windows takes
hours: `scripts/benchmark_bf16_gemm.py`).

Needs about 14 GB of free RAM in float32 (the 7.7 GB of weights, 1.9 GB of ghost statistics, copies of the
blocks that a fold or a LoRA merge changes) and 45 GB of disk (the float32 folder, four exported views of
6.8 GB; each exported folder is deleted once reloaded unless `--keep`). `--tiny` runs the same steps on a
hidden-64 model in seconds (what tests/test_rehearsal.py runs). `scripts/device_check.py` reuses `Phases`,
`fit_hooks` and the model and tokenizer builders.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


def rss_bytes() -> int:
    """This process's resident set size."""
    if importlib.util.find_spec("psutil") is not None:
        import psutil

        return psutil.Process().memory_info().rss
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status and psutil is not installed")


def anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon): what it allocated itself, not the page cache of files it
    maps (a model read from memory-mapped safetensors files counts there only while it is copied out)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not in /proc/self/status (Linux 4.5 or newer reports it)")


class Phases:
    """Seconds, peak RSS and (on a GPU) peak `torch.cuda.max_memory_allocated` per named phase.

    `enter(name)` closes the current phase and opens `name` (a phase entered again accumulates seconds and
    keeps its highest peaks); a thread samples RSS every `interval` seconds. `mark_loaded(model)` takes the
    baseline the peaks are reported above: RSS with the model loaded (on a GPU: the memory allocated when the
    `load` phase ends, the model moved there)."""

    def __init__(self, cuda: bool = False, interval: float = 0.01) -> None:
        self.cuda = cuda
        self.interval = interval
        self.records: dict[str, dict] = {}
        self.extra: dict = {}
        self.baseline_rss: int | None = None
        self.baseline_gpu: int | None = None
        self.start_rss = rss_bytes()
        self._lock = threading.Lock()
        self._name = "startup"
        self._since = time.perf_counter()
        self._peak = self.start_rss
        self._peak_anon = anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            rss, anon = rss_bytes(), anon_bytes()
            with self._lock:
                self._peak = max(self._peak, rss)
                self._peak_anon = max(self._peak_anon, anon)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    @property
    def current(self) -> str:
        return self._name

    def enter(self, name: str) -> None:
        self._sync()
        now, rss, anon = time.perf_counter(), rss_bytes(), anon_bytes()
        with self._lock:
            peak = max(self._peak, rss)
            record = self.records.setdefault(
                self._name, {"seconds": 0.0, "peak_rss": 0, "peak_gpu": 0, "peak_rss_anon": 0}
            )
            record["seconds"] += now - self._since
            record["peak_rss"] = max(record["peak_rss"], peak)
            record["peak_rss_anon"] = max(record["peak_rss_anon"], self._peak_anon, anon)
            if self.cuda:
                import torch

                if self._name == "load" and name != "load":
                    # The model reaches the GPU at the end of `load` (loaded on the CPU, then moved).
                    self.baseline_gpu = torch.cuda.memory_allocated()
                record["peak_gpu"] = max(record["peak_gpu"], torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            self._name, self._since, self._peak, self._peak_anon = name, now, rss, anon

    def mark_loaded(self, model=None) -> None:
        """The model is loaded: make its weights resident (`from_pretrained` maps safetensors files lazily, so
        RSS right after loading holds almost none of them) and take the baseline."""
        if model is not None:
            touch(model)
        self._sync()
        self.baseline_rss = rss_bytes()
        if self.cuda:
            import torch

            self.baseline_gpu = torch.cuda.memory_allocated()

    def close(self) -> dict:
        """Stop sampling; the summary (GiB and seconds per phase)."""
        self.enter("end")
        self._stop.set()
        self._thread.join()
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


# -------------------------------------------------------------------------------------------- the runs

RECOVERY_ALL = [
    {"name": "ghost"},
    {"name": "ghost_paper", "fit": "plain"},
    {"name": "linearpatch", "method": "linearpatch"},
    {"name": "replaceme", "method": "replaceme"},
    {"name": "magnitude", "method": "magnitude"},
]
RECOVERY_DISTILLED = RECOVERY_ALL[:1] + RECOVERY_ALL[2:3]
EVAL_SOURCE = {"name": "wikitext2", "source": str(WIKITEXT_HEAD), "join": ""}


def fit_args(
    model_dir: Path,
    run: Path,
    dtype: str,
    *,
    train: str,
    recovery: list[dict] | None,
    layers: list[int],
    steps: int = 2,
    samples: int = 4,
    seq_len: int = 64,
    eval_windows: int = 2,
    val_windows: int = 1,
    batch_size: int = 2,
    accelerator: str = "cpu",
    precision: str | None = None,
    export: list[str] | None = None,
    keep: str = "last",
    lr: float = 1e-2,
    students: list[dict] | None = None,
) -> list[str]:
    """`fit` arguments: configs/llama3_11.yaml (the paper's setting) with one device, the shipped excerpts and
    the given sizes (calibration and training on `samples` × `seq_len` tokens of C4, evaluation on
    `eval_windows` × `seq_len` of WikiText-2, validation on `val_windows` C4 windows after document 50). The
    students keep their last step, at a learning rate (operators and adapters) large enough that two steps
    change them measurably: an exported `_ft` view then differs from its closed form. `students`: the
    config's extra students (llama3_11's ghost_lora_ft) when None, else these (`[]`: the fair pair only)."""
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "llama3_11.yaml"),
        "--trainer.accelerator",
        accelerator,
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
        "--calibration.progress",
        "false",
        "--model.model.source",
        str(model_dir),
        "--model.model.dtype",
        dtype,
        "--model.plan.layers",
        json.dumps(layers),
        "--model.plan.num_layers",
        "null",
        "--model.distill.methods",
        "[ghost, linearpatch]",
        "--model.distill.train",
        f"[{train}]",
        "--model.distill.warmup_steps",
        "1",
        "--model.distill.val_every",
        "0",
        "--model.distill.keep",  # the fine-tuned views end at the last step: exports carry trained values
        keep,
        "--model.distill.lr",
        str(lr),
        "--model.distill.lora.lr",
        str(lr),
        "--data.calibration.source",
        json.dumps({"source": str(C4_HEAD)}),
        "--data.calibration.num_samples",
        str(samples),
        "--data.calibration.seq_len",
        str(seq_len),
        "--data.train.source",
        "null",
        "--data.train.seq_len",  # unused (training reads the calibration windows), but checked against the model
        str(seq_len),
        "--data.validation.source",
        json.dumps({"source": str(C4_HEAD), "first_document": 50}),
        "--data.validation.num_windows",
        str(val_windows),
        "--data.validation.seq_len",
        str(seq_len),
        "--data.evaluation.sources",
        json.dumps([EVAL_SOURCE]),
        "--data.evaluation.seq_len",
        str(seq_len),
        "--data.evaluation.max_windows",
        str(eval_windows),
        "--data.batch_size",
        str(batch_size),
    ]
    if recovery is not None:
        args += ["--model.recovery", json.dumps(recovery)]
    if students is not None:
        args += ["--model.distill.students", json.dumps(students)]
    if precision:
        args += ["--trainer.precision", precision]
    if export:
        args += ["--export.views", json.dumps(export), "--export.overwrite", "true"]
    return args


def worker(kind: str, out: str, args: list[str]) -> None:
    """One step in this process: `fit` or `export` through `ghostdistill.cli.main`, or `reload`
    (scripts/reload_check.py, ghostdistill unimportable); writes the phase summary to `out`."""
    phases = Phases()
    status = {"kind": kind, "ok": False}
    try:
        if kind == "build":
            spec = json.loads(args[1])
            status["model"] = build_model_dir(Path(args[0]), spec["shape"], spec["layers"])
        elif kind == "fit":
            steps = fit_hooks(phases)
            from ghostdistill.cli import main

            main(args)
            status["steps"] = steps
            status["timings"] = ACTIVE["timings"]
        elif kind == "export":
            export_hooks(phases)
            from ghostdistill.cli import main

            main(args)
        elif kind == "build_streamed":
            from rehearsal_offload import build_streamed

            spec = json.loads(args[1])
            status["model"] = build_streamed(Path(args[0]), spec["shape"], spec["layers"], spec["dtype"])
        elif kind == "gguf":
            from rehearsal_offload import gguf_check

            gguf_check(*args)
        elif kind == "reload":
            spec = importlib.util.spec_from_file_location("reload_check", ROOT / "scripts" / "reload_check.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)  # makes ghostdistill unimportable in this process
            auto = module.AutoModelForCausalLM
            original = auto.from_pretrained

            def from_pretrained(*a, **k):
                phases.enter("reload")
                model = original(*a, **k)
                phases.mark_loaded(model)
                phases.enter("reload_run")
                return model

            auto.from_pretrained = staticmethod(from_pretrained)
            module.main(*args)
        else:
            raise ValueError(f"unknown worker {kind!r}")
        status["ok"] = True
    finally:
        status.update(phases.close())
        Path(out).write_text(json.dumps(status))


def run_worker(kind: str, args: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> dict:
    """`worker(kind, ...)` in a fresh process; its summary, with `returncode` and the tail of its output."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    start = time.perf_counter()
    with open(log, "a") as sink:
        sink.write(f"\n===== {kind}: {' '.join(args)}\n")
        sink.flush()
        done = subprocess.run(
            [sys.executable, __file__, "worker", kind, str(out), *args],
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


def reload_inputs(model_dir: Path, seq_len: int, windows: int, dtype: str, path: Path) -> None:
    """scripts/reload_check.py's inputs: four left-padded prompts, 8 new tokens, and the run's evaluation
    windows (cut as `fit` cuts them)."""
    import torch
    from transformers import AutoTokenizer

    from ghostdistill.data import TextSource, evaluation_windows

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    enc = tok(
        ["The capital of France is", "In 1969, the first", "A model", "Once upon a time"],
        return_tensors="pt",
        padding=True,
    )
    ids = evaluation_windows(tok, TextSource(**EVAL_SOURCE), seq_len, windows)
    torch.save(
        {
            "ids": enc["input_ids"],
            "mask": enc["attention_mask"],
            "new": 8,
            "windows": ids,
            "batch_size": 2,
            "dtype": getattr(torch, dtype),
        },
        path,
    )


def rehearse(
    model_dir: Path, work: Path, dtype: str, tiny: bool, keep: bool, log: Path, windows: dict | None = None
) -> dict:
    """Both runs, the exports and the reloads for one dtype; the JSON line's content. `windows`: `samples`,
    `seq_len` and `batch_size` of `fit_args` (default 4 × 64 tokens, batches of 2)."""
    windows = {"samples": 4, "seq_len": 64, "batch_size": 2, **(windows or {})}

    shape = TINY if tiny else LLAMA3_8B
    result: dict = {
        "dtype": dtype,
        "width": "tiny" if tiny else "llama3_8b",
        "blocks": 4,
        "windows": windows,
        "checks": {},
    }
    counts = parameter_count(shape, 4)
    bytes_per = 4 if dtype == "float32" else 2
    result["model"] = {
        **{k: shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")},
        "intermediate_size": shape["intermediate_size"],
        "params": counts["total"],
        "weights_gib": round(counts["total"] * bytes_per / GIB, 3),
    }
    failures: list[str] = []
    # Each finished step's summary: a rerun with the same --dir and windows resumes after it.
    steps = work / (
        "steps"
        if windows == {"samples": 4, "seq_len": 64, "batch_size": 2}
        else "steps_{samples}x{seq_len}_b{batch_size}".format(**windows)
    )
    runs = {}
    for name, train, recovery in (("operators", "operators", RECOVERY_ALL), ("lora", "lora", RECOVERY_DISTILLED)):
        run = work / f"run_{dtype}_{name}"
        # The fair pair with one recipe per run (operators, then LoRA): the config's ghost_lora_ft student
        # trains both, each measured here at the real width.
        args = fit_args(model_dir, run, dtype, train=train, recovery=recovery, layers=[1], students=[], **windows)
        runs[name] = step(
            steps / f"{dtype}_fit_{name}.json",
            [run / "results.json"],
            run,
            functools.partial(run_worker, "fit", args, log),
        )
        if not runs[name]["ok"]:
            failures.append(f"fit {name}: exit {runs[name]['returncode']}")
    exports, reloads = {}, {}
    plan = {"operators": ["ghost", "ghost_ft", "linearpatch", "replaceme"], "lora": ["ghost_ft"]}
    inputs = work / f"inputs_{dtype}.pt"
    reload_inputs(model_dir, windows["seq_len"], 2, dtype, inputs)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for name, views in plan.items():
        run = work / f"run_{dtype}_{name}"
        if not runs[name]["ok"]:
            continue
        folder = work / f"export_{dtype}_{name}"
        report = json.loads((run / "results.json").read_text())
        remaining = [v for v in views if not (steps / f"{dtype}_reload_{name}_{v}.json").is_file()]
        args = ["export", str(run), "--views", *views, "--dir", str(folder), "--overwrite"]
        exports[name] = step(
            steps / f"{dtype}_export_{name}.json",
            [folder / v / "config.json" for v in remaining],
            folder,
            functools.partial(run_worker, "export", args, log),
        )
        if not exports[name]["ok"]:
            failures.append(f"export {name}: exit {exports[name]['returncode']}")
            continue
        for view in views:
            key = f"{name}/{view}"
            reloads[key] = step(
                steps / f"{dtype}_reload_{name}_{view}.json",
                [],
                None,
                functools.partial(reload_view, folder / view, inputs, work, log, report, view),
            )
            if not reloads[key]["ok"]:
                failures.append(f"reload {key}: exit {reloads[key]['returncode']}")
                continue
            ppl = reloads[key]["ppl"]
            rel = ppl["relative_difference"]
            result["checks"][f"ppl {key}"] = rel <= tol
            if rel > tol:
                failures.append(f"reload {key}: perplexity {ppl['reloaded']:.6g}, run {ppl['run']:.6g} (rel {rel:.2e})")
            result["checks"][f"generates {key}"] = reloads[key]["generated_shape"] == [4, inputs_len(inputs) + 8]
            if view.endswith("_ft"):
                # The trained values reached the folder: the fine-tuned view is not its closed form.
                moved = abs(ppl["reloaded"] - ppl["closed_form"]) / ppl["closed_form"]
                trained = moved > max(1e-4, 3 * rel)  # clearly more than the export's own round-off
                result["checks"][f"trained {key}"] = trained
                if not trained:
                    failures.append(f"reload {key}: perplexity {ppl['reloaded']:.6g} is the closed form's")
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    result["peak_above_model_gib"] = peaks(runs, exports, reloads)
    result["seconds"] = seconds(runs, exports, reloads)
    result["loaded_rss_gib"] = runs["operators"].get("loaded_rss_gib")
    result["distill_step_s"] = {
        name: [round(s["seconds"], 2) for s in r.get("steps", [])] for name, r in runs.items() if r.get("steps")
    }
    result["reload_ppl"] = {k: r["ppl"] for k, r in reloads.items() if "ppl" in r}
    result["failures"] = failures
    result["ok"] = not failures
    result["logs"] = str(log)
    return result


def step(record: Path, outputs: list[Path], fresh: Path | None, make) -> dict:
    """A step's summary: the one `record` holds when the step finished before and its `outputs` still exist
    (a rehearsal interrupted by a signal resumes after its last finished step); otherwise `make()` runs (after
    removing `fresh`, so that a run is measured from its start) and a successful summary is recorded."""
    if record.is_file() and all(p.exists() for p in outputs):
        return {**json.loads(record.read_text()), "resumed": True}
    if fresh is not None:
        shutil.rmtree(fresh, ignore_errors=True)
    summary = make()
    if summary.get("ok"):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(summary))
    return summary


def reload_view(folder: Path, inputs: Path, work: Path, log: Path, report: dict, view: str) -> dict:
    """scripts/reload_check.py on an exported folder in a fresh process without ghostdistill; its perplexity
    beside the run's (and, for a fine-tuned view, its closed form's)."""
    import torch

    out = work / f"reload_{folder.parent.name}_{view}.pt"
    env = {"PYTHONPATH": "", "HF_MODULES_CACHE": str(work / "modules")}
    summary = run_worker("reload", [str(folder), str(inputs), str(out)], log, env=env)
    if not summary["ok"]:
        return summary
    got = torch.load(out)
    out.unlink()
    metrics = report["views"]
    want = metrics[view]["metrics"]["wikitext2"]["ppl"]
    summary["ppl"] = {"run": want, "reloaded": got["ppl"], "relative_difference": abs(got["ppl"] - want) / want}
    if view.endswith("_ft"):
        summary["ppl"]["closed_form"] = metrics[view.removesuffix("_ft")]["metrics"]["wikitext2"]["ppl"]
    summary["generated_shape"] = list(got["tokens"].shape)
    return summary


def inputs_len(path: Path) -> int:
    import torch

    return int(torch.load(path)["ids"].shape[1])


def _phase(summary: dict, name: str, key: str) -> float | None:
    return (summary.get("phases") or {}).get(name, {}).get(key)


def peaks(runs: dict, exports: dict, reloads: dict) -> dict:
    """Peak RSS above the loaded model per phase: the operators run's phases, the LoRA run's distillation,
    the highest export and the highest reload (each above its own process's loaded model)."""
    key = "peak_rss_above_model_gib"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: _phase(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = _phase(b, "distillation", key)
    out["analysis"] = _phase(a, "analysis", key)
    values = [_phase(e, "export", key) for e in exports.values()]
    out["export"] = max((v for v in values if v is not None), default=None)
    values = [max(_phase(r, "reload", key) or 0, _phase(r, "reload_run", key) or 0) for r in reloads.values()]
    out["reload"] = max(values, default=None)
    return out


def seconds(runs: dict, exports: dict, reloads: dict) -> dict:
    key = "seconds"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: _phase(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = _phase(b, "distillation", key)
    out["analysis"] = _phase(a, "analysis", key)
    out["export"] = round(sum(_phase(e, "export", key) or 0 for e in exports.values()), 2)
    out["reload"] = round(
        sum((_phase(r, "reload", key) or 0) + (_phase(r, "reload_run", key) or 0) for r in reloads.values()), 2
    )
    out["total_wall"] = round(sum(r.get("wall_s", 0) for group in (runs, exports, reloads) for r in group.values()), 1)
    return out


def same_model(folder: Path, shape: dict, num_layers: int) -> bool:
    """Whether `folder` holds a complete model of this shape (built by an earlier call), to be reused."""
    config = folder / "config.json"
    if not config.is_file() or not (folder / "tokenizer.json").is_file():
        return False
    saved = json.loads(config.read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return saved.get("num_hidden_layers") == num_layers and all(saved.get(k) == shape[k] for k in keys)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--dir", default=None, help="work folder (model, runs, exports); default a temporary one")
    parser.add_argument("--tiny", action="store_true", help="a hidden-64 model: the same steps in seconds")
    parser.add_argument("--keep", action="store_true", help="keep the exported folders (and a temporary --dir)")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument(
        "--windows",
        type=int,
        nargs=3,
        default=None,
        metavar=("SAMPLES", "SEQ_LEN", "BATCH"),
        help="calibration windows (training reads them) and their length, and the batch size (default 4 64 2; "
        "with --offload 8 128 4). "
        "On a CPU without bfloat16 arithmetic (no AVX-512 BF16/AMX) a bfloat16 backward takes a scalar GEMM "
        "path hundreds of times slower than float32: 16 16 1 keeps the calibration at 256 tokens and a "
        "distillation step at 16",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "cpu", "disk"],
        default="none",
        help="model.model.offload: with cpu or disk, the full-depth rehearsal (scripts/rehearsal_offload.py): "
        "training-free, `--blocks` blocks, one --dtype",
    )
    parser.add_argument("--blocks", type=int, default=None, help="with --offload: the depth (default 32)")
    parser.add_argument("--eval-windows", type=int, default=4, help="with --offload: evaluation windows (default 4)")
    parser.add_argument("--json", default=None, help="with --offload: write the result JSON to this file")
    args = parser.parse_args(argv)
    if args.offload != "none":
        return [offload_main(args)]
    if args.blocks not in (None, 4):
        parser.error(f"--blocks {args.blocks}: the rehearsal with distillation has 4 blocks; pass --offload disk")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rehearsal_8b_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "rehearsal.log"
    model_dir = work / ("model_tiny" if args.tiny else "model_llama3_8b_width_4_blocks")
    shape = TINY if args.tiny else LLAMA3_8B
    build = None
    if not same_model(model_dir, shape, 4):
        shutil.rmtree(model_dir, ignore_errors=True)
        build = run_worker("build", [str(model_dir), json.dumps({"shape": shape, "layers": 4})], log)
        if not build["ok"]:
            raise SystemExit(f"building the model failed:\n{build.get('log_tail', '')}")
    lines = []
    try:
        for dtype in args.dtype:
            windows = dict(zip(("samples", "seq_len", "batch_size"), args.windows or [4, 64, 2]))
            result = rehearse(model_dir, work, dtype, args.tiny, args.keep, log, windows)
            if build is not None:
                result["build"] = {**build.get("model", {}), "peak_rss_gib": _phase(build, "startup", "peak_rss_gib")}
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            lines.append(result)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return lines


def offload_main(args) -> dict:
    """The full-depth rehearsal with offloaded weights (scripts/rehearsal_offload.py), one dtype."""
    from rehearsal_offload import rehearse

    if len(args.dtype) != 1:
        raise SystemExit(f"--offload {args.offload}: give one --dtype (got {' '.join(args.dtype)})")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rehearsal_offload_"))
    work.mkdir(parents=True, exist_ok=True)
    samples, seq_len, batch = args.windows or [8, 128, 4]
    windows = {"samples": samples, "seq_len": seq_len, "batch_size": batch, "eval_windows": args.eval_windows}
    try:
        result = rehearse(
            work, args.blocks or 32, args.dtype[0], args.offload, args.tiny, args.keep, windows, work / "rehearsal.log"
        )
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        results = main()
        if not all(r["ok"] for r in results):
            raise SystemExit(1)
