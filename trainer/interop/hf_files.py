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

WEIGHTS_FILE = "model.safetensors"


def write_weights(tensors: dict[str, np.ndarray], out_dir: str) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})


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
