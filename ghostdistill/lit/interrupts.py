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
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(SystemExit):
    """Raised by the SIGTERM handler; exits with status 128 + signal number."""


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
        raise Terminated(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
