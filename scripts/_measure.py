"""Shared by the benchmark scripts: device synchronisation and peak-memory probes."""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def start_peak(device: torch.device) -> int:
    """Reset the peak-memory mark (CUDA allocator, or the kernel's peak RSS) and return the baseline."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def peak_since(device: torch.device, base: int) -> int:
    """Peak memory above `base` since `start_peak`."""
    sync(device)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else status_bytes("VmHWM")
    return peak - base


def calibrated_run(
    model: str,
    dtype: str,
    layers: list[int],
    recovery: list,
    *,
    seq_len: int,
    windows: int,
    batch_size: int,
    data: str | None = None,
    distill=None,
    device: torch.device | str = "cpu",
):
    """A `Run` (the one `fit` drives) through setup, plan, calibrate and fit, on `windows` calibration windows
    of `data` (default: the C4 excerpt in data/), with no run folder: what a benchmark measures after it."""
    from pathlib import Path

    from ghostdistill.core.model import ModelConfig
    from ghostdistill.data import TextSource
    from ghostdistill.pipeline.config import RunConfig
    from ghostdistill.pipeline.data import CalibrationData, DataConfig, EvaluationData
    from ghostdistill.pipeline.run import Run
    from ghostdistill.planning import PlanConfig

    shipped = Path(__file__).resolve().parents[1] / "data"
    source = data or str(shipped / "c4_validation_head100.jsonl.gz")
    cfg = RunConfig(
        model=ModelConfig(source=model, dtype=dtype),
        plan=PlanConfig(layers=list(layers), num_layers=None),
        recovery=list(recovery),
        data=DataConfig(
            calibration=CalibrationData(source=TextSource(source=source), num_samples=windows, seq_len=seq_len),
            # Not scored here; named so that the checks before calibration read nothing from a hub.
            evaluation=EvaluationData(sources=[TextSource(source=str(shipped / "wikitext2_test_head.raw"))]),
            batch_size=batch_size,
        ),
        **({"distill": distill} if distill is not None else {}),
    )
    run = Run(cfg, log=lambda message: None)
    run.setup()
    run.llm.to(device)
    run.calibrate()
    return run
