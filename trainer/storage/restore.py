"""Trained parameters out of a workdir, for evaluation, generation and export.

Only the parameters are read (no optimiser state in memory), straight into the
shardings of whatever mesh the config now asks for, and nothing in the workdir
is created, cleaned up or deleted.
"""

from __future__ import annotations

import os

from trainer.errors import ConfigError
from trainer.storage import workdir as wd
from trainer.storage.checkpoint import Checkpointer
from trainer.storage.resume import check_architecture
from trainer.training.setup import Setup, build
from trainer.training.state import abstract_params


def load_params(cfg, workdir: str, step: int | None = None, devices=None) -> tuple[Setup, int, dict]:
    """(setup, step, params) for the newest checkpoint, or the one at `step`."""
    setup = build(cfg, devices)
    check_architecture(workdir, cfg)
    directory = wd.checkpoint_dir(workdir)
    steps = Checkpointer(directory, read_only=True).steps() if os.path.isdir(directory) else []
    if not steps:
        raise ConfigError(f"{workdir} holds no checkpoints; train there first, or pass the --workdir of a run.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"{workdir} has no checkpoint at step {step}; it has steps {steps}.")
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return setup, step, ckpt.restore_params(step, abstract_params(setup.model, setup.shard))
    finally:
        ckpt.close()
