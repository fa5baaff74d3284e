"""core/measure.py: the peak memory of spans (on the CPU: the process's peak resident set), and the sampled
peak of a memory field the kernel keeps no peak of."""

from __future__ import annotations

import time

import pytest

from ghostdistill.core.measure import PeakMemory, SampledPeak, status_bytes

MIB = 2**20
NO_PROC = pytest.mark.skipif(status_bytes("VmHWM") is None, reason="no /proc/self/status VmHWM here")


def _touched(size: int) -> bytearray:
    block = bytearray(size)
    block[::4096] = b"x" * len(block[::4096])  # touched, so resident
    return block


@NO_PROC
def test_an_outer_span_sees_the_peak_of_the_spans_inside_it():
    peak = PeakMemory()
    peak.start()
    peak.start()
    block = _touched(256 * MIB)
    del block
    inner = peak.stop()
    peak.start()
    small = peak.stop()
    outer = peak.stop()
    assert inner is not None and small is not None and outer is not None
    assert outer >= inner >= small + 200 * MIB  # the counter was reset after the big span


@NO_PROC
def test_spans_that_do_not_nest_each_see_their_own_peak():
    """A script's phases (one after another) over a run's (nested), in the one measurer: each span closed by
    its key still sees the highest value reached while it was open."""
    peak = PeakMemory()
    peak.start("script a")
    peak.start("run")
    block = _touched(256 * MIB)
    del block
    a = peak.stop("script a")
    peak.start("script b")
    run, b = peak.stop("run"), peak.stop("script b")
    assert a is not None and run is not None and b is not None
    assert run >= a >= b + 200 * MIB


@pytest.mark.skipif(status_bytes("RssAnon") is None, reason="no /proc/self/status RssAnon here")
def test_a_sampled_peak_is_the_highest_value_since_the_last_take():
    sampled = SampledPeak(("VmRSS", "RssAnon"), interval=0.005)
    try:
        block = _touched(256 * MIB)
        time.sleep(0.05)
        del block
        big = sampled.take()
        time.sleep(0.02)
        small = sampled.take()
    finally:
        last = sampled.close()
    assert all(b >= s + 200 * MIB for b, s in zip(big, small))  # VmRSS and RssAnon: the block was anonymous
    assert len(last) == 2 and all(v > 0 for v in last)
