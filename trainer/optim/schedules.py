"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD.

Warmup reaches the peak at its last step: lr(s) = peak * (s + 1) / warmup for
s < warmup, so the very first update is not wasted at lr = 0.

- cosine / linear: decay from peak to peak * min_lr_ratio over `decay_steps`
  after warmup (0 = until the end of training), then hold.
- constant: hold the peak after warmup.
- wsd (warmup-stable-decay): hold the peak, then decay (linear or cosine) over
  the last `decay_fraction` of training. A run can be branched from any stable
  checkpoint and cooled down, which is why long runs favour it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from trainer.errors import ConfigError


def _wsd_decay(optim_cfg, total_steps: int) -> tuple[int, int]:
    """(first step of the WSD decay, its length in steps)."""
    decay_len = max(1, round(optim_cfg.decay_fraction * total_steps))
    return total_steps - decay_len, decay_len


def check(optim_cfg, total_steps: int) -> None:
    if optim_cfg.schedule == "wsd":
        decay_start, _ = _wsd_decay(optim_cfg, total_steps)
        if decay_start < optim_cfg.warmup_steps:
            raise ConfigError(
                f"the WSD decay starts at step {decay_start} (last {optim_cfg.decay_fraction:g} of "
                f"{total_steps} steps), before warmup ends at {optim_cfg.warmup_steps}; lower "
                "optim.warmup_steps or optim.decay_fraction."
            )


def make_schedule(optim_cfg, total_steps: int) -> optax.Schedule:
    peak = float(optim_cfg.lr)
    floor = peak * float(optim_cfg.min_lr_ratio)
    warmup = int(optim_cfg.warmup_steps)
    if optim_cfg.schedule == "wsd":
        decay_start, decay_len = _wsd_decay(optim_cfg, total_steps)
        shape = optim_cfg.decay_shape
    else:
        decay_start = warmup
        decay_len = max(1, int(optim_cfg.decay_steps) or total_steps - warmup)
        shape = {"cosine": "cosine", "linear": "linear", "constant": None}[optim_cfg.schedule]

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (s + 1.0) / max(warmup, 1))
        progress = jnp.clip((s - decay_start) / decay_len, 0.0, 1.0)
        if shape is None:
            after = jnp.full_like(s, peak)
        elif shape == "linear":
            after = peak - (peak - floor) * progress
        else:
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(s < warmup, warm, after)

    return schedule
