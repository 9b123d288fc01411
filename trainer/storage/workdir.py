"""The run directory: where its checkpoints live, its resolved config, and whether it is writable.

What may change when a run resumes is decided in trainer/storage/resume.py.
"""

from __future__ import annotations

import json
import os

from trainer.config import to_json
from trainer.errors import ConfigError

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def saved_steps(workdir: str) -> list[int]:
    """Steps of the complete checkpoints under the workdir, from the directory listing alone.

    Orbax writes into a temporary directory and renames it to the step number
    when complete, so a name of digits is a whole checkpoint. No Orbax manager
    is made here: its constructor synchronises all processes, and each process
    decides for itself whether to look.
    """
    directory = checkpoint_dir(workdir)
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def saved_config(workdir: str) -> dict | None:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_writable(workdir: str) -> None:
    """Create the workdir and its checkpoint directory now, so a bad path fails before training, not after."""
    import jax

    # One probe per process: several processes check the same shared directory at once.
    probe = os.path.join(checkpoint_dir(workdir), f".write_probe_{jax.process_index()}")
    try:
        os.makedirs(checkpoint_dir(workdir), exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(
            f"cannot write checkpoints under {workdir} ({e.strerror}); choose a writable --workdir."
        ) from e


def write_config(workdir: str, cfg) -> None:
    tmp = os.path.join(workdir, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(to_json(cfg))
    os.replace(tmp, os.path.join(workdir, CONFIG_FILE))
