"""Where logged numbers and text go: the console, metrics.jsonl and the trackers (TensorBoard, W&B:
trainer/storage/trackers.py).

Only one process (jax.process_index() == 0) writes. A run never deletes a
record: on resume, records past the restored step (logged after the last
checkpoint of an interrupted run) are moved to metrics.superseded.jsonl, so
metrics.jsonl holds one history with no repeated steps and nothing is lost. A
fresh start in a workdir whose history shows that a checkpoint was once there
is refused (check_fresh_start). The files are written through the workdir's
GrowingFiles (copied into a bucket whole, trainer/storage/workdir.py).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from trainer.config.errors import ConfigError
from trainer.storage import workdir as wd
from trainer.storage.goodput import duration
from trainer.storage.trackers import TensorBoard, WandB
from trainer.storage.workdir import GrowingFiles

METRICS_FILE, SUPERSEDED_FILE = "metrics.jsonl", "metrics.superseded.jsonl"


def _finite_or_none(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def _step_of(line: str) -> int | None:
    """The record's step; None for a line cut short by a killed process."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError):
        return None


def read_records(workdir: str) -> list[dict] | None:
    """The records of a workdir's metrics.jsonl (local or in a bucket), in order, less a last line cut short
    by a killed process; None where there is no metrics.jsonl."""
    file = wd.path(workdir) / METRICS_FILE
    if not file.exists():
        return None
    records = []
    for line in file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def check_fresh_start(workdir: str, cfg) -> None:
    """Refuse to start afresh (no checkpoint to resume) in a workdir whose history proves that a checkpoint
    was there: records at step 2 x checkpoint.every_steps or later. The loop logs step 2e only after its
    save at step 2e has returned, which waits for the save at step e to be committed. A shorter history
    (a run stopped before its first checkpoint) is moved aside by the new run's MetricsWriter instead."""
    steps = [r["step"] for r in read_records(workdir) or () if "step" in r]
    saved = wd.saved_config(workdir)
    every = saved["checkpoint"]["every_steps"] if saved else cfg.checkpoint.every_steps
    if steps and max(steps) >= 2 * every:
        raise ConfigError(
            f"{workdir} holds an earlier run's history ({len(steps)} records up to step {max(steps)} in "
            f"{METRICS_FILE}) but no checkpoint to resume from; to start afresh there, move {METRICS_FILE} "
            "aside first (nothing is deleted for you), or choose another --workdir."
        )


class MetricsWriter:
    """`files` None: a process that does not write (all but process 0). `cfg` None: no trackers.
    `fresh`: a run that starts from step 0 (W&B then begins a new run, trainer/storage/trackers.py)."""

    def __init__(
        self, files: GrowingFiles | None, *, resume_step: int = 0, cfg=None, workdir: str = "", fresh: bool = False
    ):
        self.files = files
        if files is None:
            return
        self.path = files.fetch(METRICS_FILE)
        self._set_aside_records_after(resume_step)
        self._jsonl = open(self.path, "a")
        names = cfg.train.trackers if cfg is not None else ()
        self._trackers = []
        try:  # a tracker that fails to start leaves none of the others running
            if "tensorboard" in names:
                self._trackers.append(TensorBoard(files.dir, cfg, resume_step))
            if "wandb" in names:
                self._trackers.append(WandB(files, cfg, workdir, fresh))
        except BaseException:
            self.close()
            raise

    def _set_aside_records_after(self, step: int) -> None:
        """Move the records past `step` (and lines cut short by a killed process) to the side file: appended
        there first, then dropped here, so a kill in between repeats records but never loses one."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.readlines()
        superseded = [_step_of(line) is None or _step_of(line) > step for line in lines]
        later = [line for line, gone in zip(lines, superseded, strict=True) if gone]
        if not later:
            return
        with open(self.files.fetch(SUPERSEDED_FILE), "a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in later)
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(line for line, gone in zip(lines, superseded, strict=True) if not gone)
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


def floats(values: dict) -> dict[str, float]:
    """Scalars as floats; a vector (per-layer norms) as one entry per element."""
    out = {}
    for name, v in values.items():
        v = np.asarray(v)
        if v.ndim == 0:
            out[name] = float(v)
        else:
            out.update({f"{name}/{i}": float(x) for i, x in enumerate(v)})
    return out


def console_line(step: int, batches: float, total: int, m: dict) -> str:
    """A logged step's line on the console."""
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    scale = f"  scale {m['loss_scale']:.0f}" if m["loss_scale"] != 1.0 else ""
    # Training time left at the latest step time (evaluations and checkpoints not counted).
    eta = duration(max(total - batches, 0) * m["step_time"])
    # Under GRPO: the rollout's mean reward (a few prompts: noisy), then its moving average.
    reward = f"  reward {m['rl/reward']:.3f} (smoothed {m['rl/reward_smoothed']:.3f})" if "rl/reward" in m else ""
    return (
        f"step {step:>6} ({batches:g}/{total})  {loss_words(m)}{reward}  lr {m['lr']:.2e}  "
        f"grad_norm {m['grad_norm']:.3f}{scale}  tok/s {m['tokens_per_sec']:,.0f}  mfu {mfu}  "
        f"step {m['step_time']:.3f}s  eta {eta}"
    )


def loss_words(m: dict) -> str:
    """A step's loss in words. A distilled run's `loss` is its objective (the mix of the data's cross-entropy and
    the divergence from the teacher), which no plain run's loss can be compared with: its cross-entropy is
    shown as the loss, the objective apart (a step on the student's own samples has no cross-entropy)."""
    if "distill/cross_entropy" not in m:
        return f"loss {m['loss']:.4f}"
    if m.get("distill/on_policy"):
        return f"objective {m['loss']:.4f} (on its own samples)"
    return f"loss {m['distill/cross_entropy']:.4f} (cross-entropy; objective {m['loss']:.4f})"
