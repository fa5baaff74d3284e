"""Shared by the benchmark scripts: device synchronisation, peak memory through the package's measurer, and a
calibrated `Run` to measure after."""

from __future__ import annotations

import torch

from ghostdistill.core.measure import PEAK, status_bytes


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def start_peak(device: torch.device) -> tuple:
    """Open a span of the process's peak-memory measurer (`ghostdistill.core.measure.PEAK`: the CUDA allocator's
    peak, or the kernel's peak RSS) and take the baseline: the memory allocated on the GPU, else the RSS."""
    base = torch.cuda.memory_allocated() if device.type == "cuda" else status_bytes("VmRSS")
    return PEAK.start(), base


def peak_since(device: torch.device, started: tuple) -> int:
    """Peak memory above the baseline since `start_peak`."""
    sync(device)
    key, base = started
    return PEAK.stop(key) - base


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
    from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData
    from ghostdistill.pipeline.config import RunConfig
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
