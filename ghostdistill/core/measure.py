"""Peak memory of spans of work: the run's per-phase report (`pipeline.phases`), and the scripts that time
phases of their own (the rehearsals, the benchmarks), all through the process's one measurer `PEAK`.

On a GPU the peak is `torch.cuda.max_memory_allocated`; on the CPU it is the process's peak resident set
(Linux's `VmHWM`, reset through `/proc/self/clear_refs`). Both counters are process-wide and can only be
reset, so spans fold by hand: a span's peak is folded into every open span before the counter is reset, and
a span still sees the highest value reached while it was open, whichever spans opened or closed meanwhile.
Where neither counter exists the peak is None. The kernel keeps no peak of the anonymous resident set
(`RssAnon`: memory a process allocated, not the page cache of files it maps); `SampledPeak` samples it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from pathlib import Path

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (`VmRSS`, `VmHWM`, `RssAnon`) in bytes; None where there is none."""
    with contextlib.suppress(OSError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


class PeakMemory:
    """`start(key)` opens a span, `stop(key)` closes it (default: the last opened) and returns its peak in
    bytes (or None). Spans need not nest."""

    def __init__(self) -> None:
        self._open: dict[Hashable, int | None] = {}

    def _fold(self) -> None:
        """The counter's value since the last reset, into every open span; then reset."""
        cuda = torch.cuda.is_initialized()  # never true without a GPU
        now = torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")
        if now is not None:
            self._open = {k: now if p is None else max(p, now) for k, p in self._open.items()}
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError):
                _CLEAR.write_text("5")  # resets VmHWM to the current resident set

    def start(self, key: Hashable = None) -> Hashable:
        self._fold()
        key = object() if key is None else key
        self._open[key] = None
        self._fold()
        return key

    def stop(self, key: Hashable = None) -> int | None:
        self._fold()
        if key is None and self._open:
            key = next(reversed(self._open))
        return self._open.pop(key, None)


PEAK = PeakMemory()  # the process's: another instance would reset the counters under this one's spans


class SampledPeak:
    """The highest values of /proc/self/status `fields`, read every `interval` seconds by a thread until
    `close()`; `take()` returns them (a reading taken now included) and starts over from that reading."""

    def __init__(self, fields: tuple[str, ...] = ("VmRSS",), interval: float = 0.01) -> None:
        self.fields, self.interval, self._lock, self._stop = fields, interval, threading.Lock(), threading.Event()
        self._peak = [status_bytes(f) or 0 for f in fields]
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.take(reset=False)

    def take(self, reset: bool = True) -> list[int]:
        now = [status_bytes(f) or 0 for f in self.fields]
        with self._lock:
            peak = [max(p, n) for p, n in zip(self._peak, now)]
            self._peak = now if reset else peak
        return peak

    def close(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.take()
