"""A Hugging Face model directory's files: its config.json and its safetensors weights, read and written with
safetensors' numpy API (no torch needed). trainer/interop/huggingface.py and beside.py read and write
through here.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from trainer.config.errors import ConfigError
from trainer.storage.workdir import shared_mode

WEIGHTS_FILE = "model.safetensors"


def write_weights(tensors: dict[str, np.ndarray], out_dir: str) -> None:
    write_safetensors(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})


def write_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """safetensors' file, readable as every other file written here: save_file creates it 0600 (through a
    private temporary file), which a shared model directory's readers cannot open."""
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata=metadata)
    shared_mode(path)


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as float32 numpy arrays."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"{hf_dir} holds no .safetensors files; give a Hugging Face model directory.")
    tensors = {}
    for path in files:
        # The flax framework reads bfloat16 too, which numpy cannot.
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                tensors[name] = np.asarray(f.get_tensor(name), np.float32)
    return tensors


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{hf_dir} has no config.json; give a Hugging Face model directory.")
    with open(path) as f:
        return json.load(f)
