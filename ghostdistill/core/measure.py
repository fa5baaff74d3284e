"""Peak memory of nested spans of work, for the run's per-phase report (`pipeline.run.Run.on_phase`).

On a GPU the peak is `torch.cuda.max_memory_allocated`; on the CPU it is the process's peak resident set
(Linux's `VmHWM`, reset through `/proc/self/clear_refs`). Both counters are process-wide and can only be
reset, so spans nest by hand: a span's peak is folded into the spans around it before the counter is
reset, and an outer span still sees the highest value reached inside it. Where neither counter exists
the peak is None.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _rss_peak() -> int | None:
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class PeakMemory:
    """`start()` opens a span, `stop()` closes the innermost one and returns its peak in bytes (or None)."""

    def __init__(self) -> None:
        self._open: list[int | None] = []

    def _fold(self) -> None:
        """The counter's value since the last reset, into every open span; then reset."""
        cuda = torch.cuda.is_initialized()  # never true without a GPU
        now = torch.cuda.max_memory_allocated() if cuda else _rss_peak()
        if now is not None:
            self._open = [now if p is None else max(p, now) for p in self._open]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError):
                _CLEAR.write_text("5")  # resets VmHWM to the current resident set

    def start(self) -> None:
        self._fold()
        self._open.append(None)
        self._fold()

    def stop(self) -> int | None:
        self._fold()
        return self._open.pop() if self._open else None
