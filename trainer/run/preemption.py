"""SIGTERM as a request to checkpoint and stop, the way schedulers announce preemption; and Ctrl-C (SIGINT)
the same, so that a user who stops a run at the terminal keeps what it trained. A second Ctrl-C, while the
save runs, stops at once, without a traceback (trainer/run/cli.py).

One process: a Python handler sets a flag. Several processes: the notice
reaches the hosts at different moments, yet they must stop at the same step,
or the collective save waits forever. JAX's distributed runtime catches
SIGTERM itself (its preemption notifier, installed by jax.distributed), shares
the notice with every process and picks the first step all of them can still
reach; `poll()` says yes on every process at that step. So the loop polls once
per iteration on every process, and the Python handler stays out of the way: Ctrl-C there is passed on to
the runtime as SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from parallelism.distributed import runtime_started

NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}


class StopRequest:
    def __init__(self, together: bool):
        self.signal: int | None = None
        self.together = together
        self.asked = False  # a Ctrl-C passed on to the runtime, whose notice arrives at a later poll
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
    """Within the block, SIGTERM or a first Ctrl-C asks the loop to stop (`.poll()`) instead of killing the
    process; a second Ctrl-C raises KeyboardInterrupt, which the scripts end in one line."""
    request = StopRequest(together=runtime_started())
    if threading.current_thread() is not threading.main_thread():
        yield request  # no handler can be set off the main thread
        return

    def interrupted(signum, frame):
        if request.requested or request.asked:
            raise KeyboardInterrupt
        request.asked = True
        print("Ctrl-C: saving a checkpoint at the end of this step, then stopping (Ctrl-C again stops without "
              "saving)", flush=True)  # fmt: skip
        if request.together:
            os.kill(os.getpid(), signal.SIGTERM)  # the runtime's notifier shares it with every process
        else:
            request.signal = signum

    def terminated(signum, frame):
        request.signal = signum

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, interrupted)}
    if not request.together:  # the runtime's notifier listens for SIGTERM itself
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, terminated)
    try:
        yield request
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
