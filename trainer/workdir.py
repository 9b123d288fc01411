"""The run directory: its resolved config, what may change on resume, and whether it is writable.

Resuming or evaluating a workdir with a config that would change the model or
the data stream is refused with the keys that differ. Keys that change only how
the run computes (mesh, remat, attention kernel, precision, logging, the
schedule's length) may change freely; that is how a run moves to another mesh.
"""

from __future__ import annotations

import json
import os

from trainer.config import to_json
from trainer.errors import ConfigError

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"

# What the parameters mean: shapes, and the functions they feed.
MODEL_KEYS = tuple(
    f"model.{k}"
    for k in (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "rope_theta",
        "norm_eps",
        "tie_embeddings",
    )
)
TOKENIZER_KEYS = ("data.tokenizer", "data.tokenizer_path")
# What a resumed run reads next: the data iterator's state is only valid for the same streams.
RESUME_KEYS = (
    MODEL_KEYS
    + TOKENIZER_KEYS
    + tuple(f"data.{k}" for k in ("source", "name", "paths", "seq_len", "packing"))
    + ("train.global_batch_size", "train.grad_accum_steps", "train.seed")
)
EVAL_KEYS = MODEL_KEYS + TOKENIZER_KEYS


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


def saved_config(workdir: str) -> dict | None:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_matches(workdir: str, cfg, keys: tuple[str, ...]) -> None:
    """Refuse a workdir whose saved config differs from `cfg` in any of `keys`."""
    saved = saved_config(workdir)
    if saved is None or not os.path.isdir(checkpoint_dir(workdir)):
        return
    current = cfg.to_dict()
    differ = []
    for key in keys:
        section, name = key.split(".")
        before, now = saved.get(section, {}).get(name), current[section][name]
        if before != now:
            differ.append(f"{key}={before!r} there, {now!r} here")
    if differ:
        raise ConfigError(
            f"{workdir} belongs to another run ({'; '.join(differ)}); use its values or another --workdir."
        )


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
