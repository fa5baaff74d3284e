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
