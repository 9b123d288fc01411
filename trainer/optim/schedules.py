"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD.

The update at step s (counted from 0) uses the rate the curve has at s + 1,
the end of that step: warmup's first update is peak / warmup (not wasted at
0) and its last the peak; a decay's first update is already below the peak
and the run's last update (step T - 1) is exactly the floor, peak x
min_lr_ratio.

- cosine / linear: decay from peak to the floor over `decay_steps` after
  warmup (0 = until the end of training), then hold.
- constant: hold the peak after warmup.
- wsd (warmup-stable-decay): hold the peak, then decay (linear or cosine) over
  the last `decay_fraction` of training. A run can be branched from any stable
  checkpoint and cooled down, which is why long runs favour it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

from trainer.config.errors import ConfigError

# A cooldown of one step would jump from the peak to the floor: WSD's decay is at least this long.
MIN_WSD_DECAY = 2


def _wsd_decay(optim_cfg, total_steps: int) -> tuple[int, int]:
    """(steps done when the WSD decay starts, its length in steps)."""
    decay_len = round(optim_cfg.decay_fraction * total_steps)
    return total_steps - decay_len, decay_len


def check(optim_cfg, total_steps: int) -> None:
    if optim_cfg.schedule == "wsd":
        decay_start, decay_len = _wsd_decay(optim_cfg, total_steps)
        if decay_len < MIN_WSD_DECAY:
            raise ConfigError(
                f"optim.decay_fraction={optim_cfg.decay_fraction:g} of train.steps={total_steps} gives a WSD decay "
                f"of {decay_len} step{'s' * (decay_len != 1)}, too short to cool down; raise optim.decay_fraction "
                f"to at least {MIN_WSD_DECAY / total_steps:.3g} (a {MIN_WSD_DECAY}-step decay) or train longer."
            )
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
        done = jnp.asarray(step, jnp.float32) + 1.0  # steps done once this update is applied
        warm = peak * jnp.minimum(1.0, done / max(warmup, 1))
        progress = jnp.clip((done - decay_start) / max(decay_len, 1), 0.0, 1.0)
        if shape is None:
            after = jnp.full_like(done, peak)
        elif shape == "linear":
            after = peak - (peak - floor) * progress
        else:
            after = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(done <= warmup, warm, after)

    return schedule
