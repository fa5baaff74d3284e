"""What the rehearsals (`scripts/rehearsal_8b.py`, `scripts/rehearsal_offload.py`) and the prepared GPU check
(`scripts/device_check.py`) share; it imports none of them.

The model's shapes (`LLAMA3_8B`, `TINY`; the builders, a small tokenizer trained on the shipped excerpts and a
random-weight folder, are in `scripts/_rehearsal_model.py`), the phases of a step measured (`Phases`: seconds,
peak RSS and RssAnon sampled by `core.measure.SampledPeak`, peak GPU memory as a span of the process's
`core.measure.PEAK`, the measurer of the run's own phases) and marked by an observer of the run's phases (`fit_hooks`, `export_hooks`), and
`run_worker`: a step in a fresh process (`python scripts/rehearsal_8b.py worker ...`).
"""

from __future__ import annotations

import contextlib
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
