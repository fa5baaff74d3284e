"""core/measure.py: the peak memory of nested spans (on the CPU: the process's peak resident set)."""

from __future__ import annotations

import pytest

from ghostdistill.core.measure import PeakMemory, _rss_peak


@pytest.mark.skipif(_rss_peak() is None, reason="no /proc/self/status VmHWM here")
def test_an_outer_span_sees_the_peak_of_the_spans_inside_it():
    peak = PeakMemory()
    peak.start()
    peak.start()
    block = bytearray(256 * 2**20)
    block[::4096] = b"x" * len(block[::4096])  # touched, so resident
    del block
    inner = peak.stop()
    peak.start()
    small = peak.stop()
    outer = peak.stop()
    assert inner is not None and small is not None and outer is not None
    assert outer >= inner >= small + 200 * 2**20  # the counter was reset after the big span
