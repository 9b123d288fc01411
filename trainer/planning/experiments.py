"""Short in-process runs that compare settings on identical data: optimisers, muP widths.

Every run of a comparison reads the same batches (the config's training data,
from its seed) and reports its loss at every step; no checkpoints, no
evaluation. The plots need matplotlib (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from parallelism.distributed import fetch
from trainer.config import forms
from trainer.data import corpora, streams
from trainer.training.setup import build


def fixed_batches(cfg, steps: int) -> list[dict]:
    """The first `steps` global batches of the config's training stream (one process)."""
    corpora.check_vocab(cfg)
    if cfg.data.source != "synthetic":
        corpora.prepare(cfg.data)
    rows = range(cfg.train.global_batch_size)
    stream = iter(streams.batches(streams.Stream.from_config(cfg), cfg.data.train_split, rows, shuffle=True))
    return [next(stream) for _ in range(steps)]


def loss_curve(cfg, batches: list[dict]) -> list[float]:
    """Train from scratch on `batches`; the loss of each step (NaN once the run has blown up)."""
    setup = build(cfg)
    state, step = setup.new_state(), setup.train_step()
    losses = []
    for b in batches:
        state, metrics = step(state, streams.to_global(b, setup.batch_sharding, len(b["tokens"])))
        loss = float(fetch(metrics["loss"]))
        losses.append(loss if math.isfinite(loss) else float("nan"))
    return losses


def widened(cfg, width: int, base_width: int, mup: bool):
    """The config at another d_model: more heads of the same size, MLP and heads in proportion."""
    m = cfg.model
    ratio = width / m.d_model
    return forms.with_changes(
        cfg, {"model.d_model": width, "model.n_heads": int(m.n_heads * ratio),
                "model.n_kv_heads": int(m.n_kv_heads * ratio), "model.d_ff": int(m.d_ff * ratio),
                "model.mup_base_width": base_width if mup else 0},
    )  # fmt: skip


def final_loss(losses: list[float], last: int = 10) -> float:
    return float(np.mean(losses[-last:]))


def plot(path: str, panels: dict[str, dict[str, tuple[list, list]]], xlabel: str, ylabel: str, logx=False) -> None:
    """One panel per key of `panels`, one line per (label -> (x, y))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        for label, (x, y) in lines.items():
            ax.plot(x, y, marker="o" if logx else None, label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel, xscale="log" if logx else "linear")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def devices_note() -> str:
    return f"{jax.device_count()} x {jax.devices()[0].device_kind}"
