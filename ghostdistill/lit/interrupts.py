"""SIGTERM stops a run in every phase, as Ctrl-C (SIGINT) does.

Why this is needed: Lightning's trainer replaces the SIGTERM handler while it runs a stage with one that
only sets `trainer.received_sigterm`, which its loops check between batches. Work that runs outside a
loop's batches never looks at the flag: the zero-shot evaluation (lm-eval inside `on_test_end`) could
run for hours after a SIGTERM, holding the cores until SIGKILL. During calibration (the callbacks'
`setup`, before Lightning installs its handler) SIGTERM already killed the process outright.

`terminate_on_sigterm` installs, for the duration of a command, a handler that raises `Terminated`
(a `SystemExit` with the conventional status 128 + 15 = 143) in the main thread. Lightning composes it
after its own handler while a stage runs (so its flag is still set and DDP workers are still told), so
the exception arrives within one Python bytecode of the signal, or when the current native operation
(one matmul) returns. It unwinds through Lightning's interrupt handling, which tears the trainer down.
Every file the run writes is written atomically (`core.io`), so what is on disk is complete: the
calibration state, saved zero-shot scores and `last.ckpt` let the same command resume.

A signal must not cut a distillation step's update in half: between `hold_signals` (the gradients are ready,
the optimizer is about to write the weights) and `release_signals` (the step's update, scheduler step and
counters are done) SIGTERM and SIGINT are recorded, not raised, and `release_signals` raises the first one.
Anywhere else in a step the weights, optimizer and scheduler are those of the last finished step, which is
what `lit.checkpoint.LastCheckpoint` saves on the way out.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(SystemExit):
    """Raised by the SIGTERM handler; exits with status 128 + signal number."""


class _Gate:
    """Whether signals are held (`hold_signals`), the one that arrived meanwhile, the SIGINT handler to restore."""

    holding = False
    pending: BaseException | None = None
    sigint = None


def hold_signals() -> None:
    """Until `release_signals`, SIGTERM (under `terminate_on_sigterm`) and SIGINT are recorded, not raised.
    Main thread only (elsewhere signals cannot be handled anyway)."""
    if _Gate.holding or threading.current_thread() is not threading.main_thread():
        return
    _Gate.holding, _Gate.pending = True, None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:

        def record(signum: int, frame) -> None:
            _Gate.pending = _Gate.pending or KeyboardInterrupt()

        _Gate.sigint = signal.signal(signal.SIGINT, record)


def release_signals(raise_pending: bool = True) -> None:
    """End `hold_signals`; raise the signal that arrived meanwhile (unless `raise_pending` is false)."""
    if not _Gate.holding:
        return
    _Gate.holding = False
    if _Gate.sigint is not None:
        signal.signal(signal.SIGINT, _Gate.sigint)
        _Gate.sigint = None
    pending, _Gate.pending = _Gate.pending, None
    if pending is not None and raise_pending:
        raise pending


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (a second SIGTERM kills at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame) -> None:
        # Whatever handler is active now (ours, or Lightning's composition around it): the next SIGTERM
        # must not wait for the clean-up this one starts.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(
            f"received signal {signum} (SIGTERM): stopping; files on disk are complete, rerun the same command to resume",
            file=sys.stderr,
            flush=True,
        )
        if _Gate.holding:  # inside a step's update: raised when it is done (`release_signals`)
            _Gate.pending = _Gate.pending or Terminated(128 + signum)
            return
        raise Terminated(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
