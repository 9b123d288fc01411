"""Where logged numbers go: the console, metrics.jsonl and TensorBoard.

Only one process (jax.process_index() == 0) writes. On resume, records past
the restored step (logged after the last checkpoint of an interrupted run) are
dropped, so metrics.jsonl holds one history with no repeated steps. The files
are written through the workdir's GrowingFiles (copied into a bucket whole,
trainer/storage/workdir.py).
"""

from __future__ import annotations

import json
import math
import os

from tensorboard.summary import Writer

from trainer.storage.workdir import GrowingFiles

METRICS_FILE = "metrics.jsonl"


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _step_of(line: str) -> int | None:
    """The record's step; None for a line cut short by a killed process."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):
        return None


class MetricsWriter:
    """`files` None: a process that does not write (all but process 0)."""

    def __init__(self, files: GrowingFiles | None, *, resume_step: int = 0):
        self.files = files
        if files is None:
            return
        self.path = files.fetch(METRICS_FILE)
        self._drop_records_after(resume_step)
        self._jsonl = open(self.path, "a")
        self._tb = Writer(files.dir)

    def _drop_records_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if _step_of(line) is not None and _step_of(line) <= step]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, self.path)

    def write(self, step: int, metrics: dict[str, float], *, console: str | None = None) -> None:
        if self.files is None:
            return
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(name, value, step)
        self._tb.flush()
        if console:
            print(console, flush=True)

    def close(self) -> None:
        if self.files is not None:
            self._jsonl.close()
            self._tb.close()
