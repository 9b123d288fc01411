"""A run that stops making progress ends itself and says where it was stuck (`train.hang_seconds`).

Every process alive and none making progress is how a long run wastes most: a
storage request that never returns, a read on a hung mount, a collective one
host never joins. Once the first step has compiled and run (on a pod, that
waits for every process's compile: the first step's collectives need them all),
the loop marks progress (`HangWatch.progress`) at each training step it
dispatches, each evaluation batch and each checkpoint it saves; compiling later
(a batch-size ramp's new size, the first samples) is neither (`suspended`). A
thread looks every second. When nothing has been marked for `hang_seconds`, it
writes every thread's stack (`thread_stacks`) and those of the data workers,
which are processes of ours, to stderr and to a file in the local temporary
directory (never the workdir or the data: their storage may be what hung), says
in one sentence the step, the wait and where the stacks are, and ends the
process with status 1; relaunching the same command resumes from the newest
complete checkpoint. On several processes it tells the others
(parallelism/distributed.py's stop_all), whose watchdogs write their own stacks
and end them too, so that the scheduler restarts the whole job.

A thread cannot run while another holds the interpreter (a C call that never
releases it): faulthandler's own timer, re-armed while progress is made,
then dumps the stacks to stderr and exits BACKSTOP_SECONDS later.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import jax

from parallelism import distributed

BACKSTOP_SECONDS = 60
_ending = threading.Lock()  # one ending per process: the watch's, or the watchdog's on another's
_said = threading.Event()  # the watch's own ending has printed its sentence


class HangWatch:
    """Ends the process when no progress is marked for `seconds` (0: never). `step()` says where the run is,
    the workdir's name goes into the stacks file's, and `workers()` gives (name, stacks) of each data worker
    process."""

    def __init__(self, seconds: float, step: Callable[[], int], workdir: str,
                 workers: Callable[[], list[tuple[str, str]]] = list):  # fmt: skip
        self.seconds, self._step, self._workers = seconds, step, workers
        self._label = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(workdir.rstrip("/"))) or "run"
        self._last: float | None = None  # when progress was last marked; None until the first mark
        self._suspended = 0
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainer-hang-watch", daemon=True)

    @property
    def armed(self) -> bool:
        return self._last is not None

    def progress(self) -> None:
        if not self.seconds:
            return
        self._last = time.monotonic()
        if not self._started:
            self._started = True
            self._thread.start()
            distributed.on_stacks_asked(self._write_on_request)

    @contextlib.contextmanager
    def suspended(self):
        """No hang is judged within (a compile), and leaving it is progress."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1
            if self._last is not None:
                self.progress()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            faulthandler.cancel_dump_traceback_later()
            distributed.on_stacks_asked(None)

    def _watch(self) -> None:
        armed_for = None  # the mark the backstop timer counts from
        while not self._stop.wait(1.0):
            last = self._last
            if self._suspended:
                faulthandler.cancel_dump_traceback_later()
                armed_for = None
                continue
            waited = time.monotonic() - last
            if waited >= self.seconds:
                self._end(waited)
                return
            if last != armed_for:
                _arm_backstop(self.seconds - waited + BACKSTOP_SECONDS)
                armed_for = last

    def _end(self, waited: float) -> None:
        if not _ending.acquire(blocking=False):
            return  # the watchdog is ending this process on another's stop
        why = f"no progress for {waited:.0f} s at step {self._step()} (train.hang_seconds={self.seconds:g})"
        where = self._write(why)
        sentence = (
            f"{why}; every thread's stack is above and in {where}; relaunching the same command resumes from the "
            "newest complete checkpoint."
        )
        print(f"error: {sentence}", file=sys.stderr, flush=True)
        _said.set()
        distributed.stop_all(sentence, stacks=True)  # several processes: the others end too, and never returns
        sys.stdout.flush()
        os._exit(1)

    def _write_on_request(self, reason: str) -> None:
        if _ending.acquire(blocking=False):
            where = self._write(reason)
            print(f"this process's stacks are above and in {where}", file=sys.stderr, flush=True)
        else:  # this process's own watch is ending it (both fired together): let it finish saying where
            _said.wait(timeout=BACKSTOP_SECONDS)

    def _write(self, reason: str) -> str:
        """Every thread's stack and the data workers', to stderr and to a local file, whose path it returns."""
        workers = self._workers()
        process = jax.process_index()
        name = f"trainer-stacks-{self._label}-process{process}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        path = os.path.join(tempfile.gettempdir(), name)
        report = f"stacks of process {process} (pid {os.getpid()}): {reason}\n\n{thread_stacks()}"
        report += "".join(f"\n{name}:\n{stacks}" for name, stacks in workers)
        with open(path, "w") as f:
            f.write(report)
        sys.stderr.write(report)
        sys.stderr.flush()
        return path


def _arm_backstop(seconds: float) -> None:
    try:  # the process's own stderr: a host that swapped sys.stderr for an object without a file keeps it
        faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr file at all: no backstop
        pass


def thread_stacks() -> str:
    """Every thread's stack, the main thread's first, threads with the same stack (idle pool workers) once.

    Not faulthandler's dump: it lists at most 100 threads, newest first, and a run with Orbax's, TensorStore's
    and gcsfs's pools has more, so the main thread was the one left out (seen in tests/test_hang.py)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)
    groups: dict[str, list[str]] = {}
    for ident, frame in frames:
        groups.setdefault("".join(traceback.format_stack(frame)), []).append(names.get(ident, str(ident)))
    parts = []
    for stack, who in groups.items():
        more = ", ..." if len(who) > 3 else ""
        named = f"thread {who[0]}" if len(who) == 1 else f"{len(who)} threads ({', '.join(who[:3])}{more})"
        parts.append(f"{named} (most recent call last):\n{stack}")
    return "\n".join(parts)
