"""Where a run's numbers and text are shown besides metrics.jsonl: TensorBoard, Weights & Biases.

`train.trackers` names them. Each gets the resolved config once, every logged
record (numbers as scalars; a skipped-step or rollback event as text and as
`events/<kind>` scalars), evaluation results and the samples' text. Both take
the step from the record, so a rollback that moves the step back draws the
stretch again rather than being dropped. A resume shows one history: TensorBoard
is told to purge what an interrupted launch logged past the restored step, W&B
continues the workdir's own run. Only process 0 tracks.
"""

from __future__ import annotations

import json
import os
import sys
import uuid

from trainer.config.errors import ConfigError
from trainer.config.forms import flatten

WANDB_ID_FILE = "wandb_id.txt"


def numbers(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# What tensorboardX imports and we never use: torch, only to accept torch tensors (~2 s where the hf extra is
# installed), and the S3 and GCS clients, only for event files written straight to a bucket (~1.6 s); ours go
# to the workdir's local files, which a bucket run copies up itself (trainer/storage/workdir.py).
UNUSED_BY_TENSORBOARD = ("torch", "boto3", "google.cloud.storage")


def _summary_writer():
    """tensorboardX's SummaryWriter, imported with UNUSED_BY_TENSORBOARD held out (each such `import` raises
    ImportError while held, which tensorboardX takes as that backend being absent). A module the process has
    imported already (a user's own code) is left as it is."""
    held = [name for name in UNUSED_BY_TENSORBOARD if name not in sys.modules]
    sys.modules.update(dict.fromkeys(held))
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in held:
            del sys.modules[name]
    return SummaryWriter


class TensorBoard:
    """Event files in the workdir, written by tensorboardX's SummaryWriter (scalars and text, no TensorFlow);
    text (config, events, samples) appears under `<tag>/text_summary`. Flushed at every log, so a killed
    launch keeps what it logged.

    Each launch's file starts with a SessionLog.START at the step after the one it resumed from (the
    writer's `purge_step`): TensorBoard's reader then purges every earlier event from that step on (what a
    killed launch logged past its last checkpoint), so a resumed run draws one line, not a zigzag."""

    def __init__(self, directory: str, cfg, resume_step: int = 0):
        SummaryWriter = _summary_writer()
        self._writer = SummaryWriter(directory, purge_step=resume_step + 1)
        self._markdown(0, "config", "```\n" + json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n```")

    def log(self, step: int, record: dict) -> None:
        if "event" in record:
            self._markdown(step, "events", f"`{json.dumps(record)}`")
            record = {f"events/{record['event']}": 1.0}
        for name, value in numbers(record).items():
            self._writer.add_scalar(name, float(value), step)
        self._writer.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        """Each prompt with its completions, as code blocks (a markdown table cell cannot hold newlines)."""
        parts = []
        for row in rows:
            parts.append(f"**{row['prompt']!r}**")
            parts += [f"{kind}:\n```\n{row['prompt']}{row[kind]}\n```" for kind in row if kind != "prompt"]
        self._markdown(step, "samples", "\n\n".join(parts))

    def _markdown(self, step: int, tag: str, markdown: str) -> None:
        self._writer.add_text(tag, markdown, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run named after the resolved workdir, with an id the workdir keeps (wandb_id.txt): a resume
    continues that W&B run, a fresh start (in a new workdir or a reused one) begins a new one, and two
    workdirs never share one, whoever runs them. Project from `train.wandb_project`; entity, mode
    (WANDB_MODE=offline needs no network) and the rest from W&B's own WANDB_* variables. Its files go
    in the workdir's `wandb/`."""

    def __init__(self, files, cfg, workdir: str, fresh: bool):
        import wandb

        from trainer.storage.workdir import path, write_file

        id_file = files.fetch(WANDB_ID_FILE)
        if fresh or not os.path.exists(id_file):
            write_file(id_file, uuid.uuid4().hex[:16])
        with open(id_file) as f:
            run_id = f.read().strip()
        self._wandb = wandb
        try:
            self._run = wandb.init(project=cfg.train.wandb_project, name=str(path(workdir)), id=run_id,
                                   resume="allow", dir=files.dir, config=flatten(cfg))  # fmt: skip
        except Exception as e:
            detail = " ".join(str(e).split())[:300]
            raise ConfigError(
                f"W&B could not start a run ({type(e).__name__}: {detail}); check WANDB_API_KEY, WANDB_MODE and "
                "the network, or set WANDB_MODE=offline to log on this machine (`wandb sync` uploads it later)."
            ) from e
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, record: dict) -> None:
        if "event" in record:
            kind = record["event"]
            record = {f"events/{kind}/{k}": v for k, v in numbers(record).items() if k != "step"}
            record[f"events/{kind}"] = 1.0
        self._run.log({**numbers(record), "step": step})

    def samples(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0])
        table = self._wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self._run.log({"samples": table, "step": step})

    def close(self) -> None:
        self._run.finish()
