"""The data workers: `data.workers` processes that read, tokenise and pack this process's rows, outside the
training process's interpreter lock (trainer/data/streams.py has the rows' streams they run)."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Sequence

import numpy as np

from trainer.config.errors import TrainingError
from trainer.data.streams import Stream, batches


class ProcessRows:
    """A `batches()` iterator whose rows are read by `workers` processes, each owning every k-th of
    this process's rows: reading, tokenising and packing run on other cores, outside the training
    process's interpreter lock. The same windows (each row is its own stream) and the same state,
    keyed by row, as the in-process iterator, so checkpoints do not depend on `data.workers`."""

    def __init__(self, stream: Stream, split: str, rows: Sequence[int], state: dict, *, shuffle: bool, workers: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # forking a process that runs JAX is unsafe
        workers = min(workers, len(rows))
        self._owner = {r: i % workers for i, r in enumerate(rows)}
        self._state = state
        self._pipes, self._processes, self._stack_pipes = [], [], []
        for w in range(workers):
            mine = [r for r in rows if self._owner[r] == w]
            parent, child = context.Pipe()
            stacks, stacks_end = context.Pipe(duplex=False)
            rows_state = {"rows": {str(r): state["rows"][str(r)] for r in mine}}
            process = context.Process(target=_serve_rows, args=(child, stream, split, mine, rows_state, shuffle,
                                                                stacks_end), daemon=True)  # fmt: skip
            process.start()
            self._pipes.append(parent)
            self._processes.append(process)
            self._stack_pipes.append(stacks)

    def read(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        asked = [[r for r in rows if self._owner[r] == w] for w in range(len(self._pipes))]
        for w, (pipe, mine) in enumerate(zip(self._pipes, asked, strict=True)):
            try:
                pipe.send(mine)
            except OSError as e:  # the worker process is gone (a broken pipe)
                self._gone(w, mine, e)
        windows, states = {}, dict(self._state["rows"])
        for w, (pipe, mine) in enumerate(zip(self._pipes, asked, strict=True)):
            try:
                kind, reply = pipe.recv()
            except (EOFError, OSError) as e:
                self._gone(w, mine, e)
            if kind == "error":
                raise TrainingError(f"data worker {w} failed: {reply}")
            batch, state = reply
            for i, r in enumerate(mine):  # a row asked twice (a batch larger than the streams) gives two windows
                windows.setdefault(r, []).append({k: v[i] for k, v in batch.items()})
            states.update(state["rows"])
        self._state = {"rows": states}
        taken = {r: iter(w) for r, w in windows.items()}
        ordered = [next(taken[r]) for r in rows]
        return {k: np.stack([w[k] for w in ordered]) for k in ordered[0]}

    def _gone(self, w: int, rows: list[int], error: Exception):
        process = self._processes[w]
        process.join(timeout=5)
        raise TrainingError(
            f"data worker {w} (pid {process.pid}) exited with code {process.exitcode} while reading rows {rows}; "
            "relaunch to resume from the newest checkpoint, or set data.workers=0 to read in the training process "
            "and see the error there."
        ) from error

    def get_state(self) -> dict:
        return self._state

    def stacks(self) -> list[tuple[str, str]]:
        """(name, every thread's stack) of each worker, which writes them on SIGUSR1 (a hang's report,
        trainer/run/hang.py), wherever it is stuck; of one that has ended, how."""
        out = []
        for w, (process, pipe) in enumerate(zip(self._processes, self._stack_pipes, strict=True)):
            if process.is_alive():
                os.kill(process.pid, signal.SIGUSR1)
                out.append((f"data worker {w} (pid {process.pid})", _read_while_written(pipe)))
            else:
                out.append((f"data worker {w} (pid {process.pid})", f"ended, exit code {process.exitcode}\n"))
        return out

    def close(self) -> None:
        """Asks each worker to stop; one that has not within 10 s (stuck reading) is terminated, then killed."""
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:  # that worker is gone already
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _read_while_written(pipe, seconds: float = 3.0) -> str:
    """What a worker's faulthandler writes into `pipe`, until it has been quiet for half a second."""
    out, end = b"", time.monotonic() + seconds
    while time.monotonic() < end and pipe.poll(0.5):
        out += os.read(pipe.fileno(), 1 << 16)
    return out.decode(errors="replace")


def _serve_rows(pipe, stream: Stream, split: str, rows: list[int], state: dict, shuffle: bool, stacks) -> None:
    """A data worker: reads the windows of the rows it is asked for, replying with them and its state; on
    SIGUSR1 it writes every thread's stack into `stacks` (faulthandler's, which runs wherever it is stuck)."""
    faulthandler.register(signal.SIGUSR1, file=stacks.fileno(), all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: the trainer decides
    iterator = iter(batches(stream, split, rows, shuffle=shuffle))
    iterator.set_state(state)
    while (asked := pipe.recv()) is not None:
        try:
            batch = iterator.read(asked) if asked else {}
            pipe.send(("ok", (batch, iterator.get_state())))
        except Exception as e:  # handed to the training process, which raises it
            pipe.send(("error", repr(e)))
