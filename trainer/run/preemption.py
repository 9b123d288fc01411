"""SIGTERM as a request to checkpoint and stop, the way schedulers announce preemption.

One process: a Python handler sets a flag. Several processes: the notice
reaches the hosts at different moments, yet they must stop at the same step,
or the collective save waits forever. JAX's distributed runtime catches
SIGTERM itself (its preemption notifier, installed by jax.distributed), shares
the notice with every process and picks the first step all of them can still
reach; `poll()` says yes on every process at that step. So the loop polls once
per iteration on every process, and the Python handler stays out of the way.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from parallelism.distributed import runtime_started


class StopRequest:
    def __init__(self, together: bool):
        self.signal: int | None = None
        self.together = together
        self._polls = 0

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def poll(self) -> bool:
        """Whether to stop now; with several processes, a collective decision (call it once per
        loop iteration on every process, so that the iteration counts agree)."""
        if self.together and self.signal is None:
            from jax.experimental import multihost_utils

            self._polls += 1
            if multihost_utils.reached_preemption_sync_point(self._polls):
                self.signal = signal.SIGTERM
        return self.requested


@contextlib.contextmanager
def watch_for_sigterm():
    """Within the block, SIGTERM asks the loop to stop (`.poll()`) instead of killing the process."""
    request = StopRequest(together=runtime_started())
    if request.together or threading.current_thread() is not threading.main_thread():
        yield request  # the runtime's notifier listens; or no handler can be set off the main thread
        return

    def handler(signum, frame):
        request.signal = signum

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)
