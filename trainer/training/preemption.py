"""SIGTERM as a request to checkpoint and stop, the way schedulers announce preemption."""

from __future__ import annotations

import contextlib
import signal
import threading


class StopRequest:
    def __init__(self):
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None


@contextlib.contextmanager
def watch_for_sigterm():
    """Within the block, SIGTERM sets `.requested` instead of killing the process."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request  # signal handlers can only be set from the main thread
        return

    def handler(signum, frame):
        request.signal = signum

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)
