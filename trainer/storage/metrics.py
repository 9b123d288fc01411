"""Where logged numbers and text go: the console, metrics.jsonl and the trackers (TensorBoard, W&B:
trainer/storage/trackers.py).

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

from trainer.storage.trackers import TensorBoard, WandB
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
    """`files` None: a process that does not write (all but process 0). `cfg` None: no trackers."""

    def __init__(self, files: GrowingFiles | None, *, resume_step: int = 0, cfg=None, workdir: str = ""):
        self.files = files
        if files is None:
            return
        self.path = files.fetch(METRICS_FILE)
        self._drop_records_after(resume_step)
        self._jsonl = open(self.path, "a")
        names = cfg.train.trackers if cfg is not None else ()
        self._trackers = ([TensorBoard(files.dir, cfg)] if "tensorboard" in names else []) + (
            [WandB(files.dir, cfg, workdir)] if "wandb" in names else []
        )

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
        self._append(record)
        for tracker in self._trackers:  # a non-finite value is left out, as it is null in metrics.jsonl
            tracker.log(step, {k: v for k, v in record.items() if v is not None and k != "step"})
        if console:
            print(console, flush=True)

    def samples(self, step: int, rows: list[dict[str, str]]) -> None:
        """Completions of the sample prompts: one record {"step", "samples": rows}, the console, the trackers."""
        if self.files is None:
            return
        self._append({"step": step, "samples": rows})
        for tracker in self._trackers:
            tracker.samples(step, rows)
        for row in rows:
            for kind in row:
                if kind != "prompt":
                    print(f"step {step:>6}  sample ({kind}): {row['prompt'] + row[kind]!r}", flush=True)

    def _append(self, record: dict) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def close(self) -> None:
        if self.files is not None:
            self._jsonl.close()
            for tracker in self._trackers:
                tracker.close()
