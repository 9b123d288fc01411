"""Batch-size ramp: start with few microbatches per step and grow to the full global batch.

Early in training small batches are as good per token as large ones and cost
fewer tokens per update. With `train.ramp_batch_size` > 0 the batch grows in
powers of two from that size to `global_batch_size` over `train.ramp_tokens`
tokens (a stage is the largest power-of-two multiple of the start not above
the linear target). The learning-rate schedule counts tokens, so the ramp does
not move it: step s of the schedule is always s full batches' worth of tokens.
"""

from __future__ import annotations

import math

from trainer.errors import ConfigError


def check(cfg, microbatch: int) -> None:
    t = cfg.train
    if not t.ramp_batch_size:
        return
    if t.ramp_batch_size % microbatch or not microbatch <= t.ramp_batch_size < t.global_batch_size:
        raise ConfigError(
            f"train.ramp_batch_size={t.ramp_batch_size} must be a multiple of the microbatch ({microbatch} "
            f"sequences) and smaller than train.global_batch_size={t.global_batch_size}."
        )
    if t.ramp_tokens <= 0:
        raise ConfigError("train.ramp_tokens must be positive when train.ramp_batch_size is set.")


def microbatches_per_step(cfg, trained_microbatches: int, microbatch: int) -> int:
    """How many microbatches the next step takes, given how many have been trained on."""
    t = cfg.train
    full = t.grad_accum_steps
    if not t.ramp_batch_size:
        return full
    start = t.ramp_batch_size // microbatch
    ramp = t.ramp_tokens / (microbatch * cfg.data.seq_len)  # in microbatches
    linear = start + (full - start) * min(1.0, trained_microbatches / ramp)
    return min(full, start * 2 ** int(math.floor(math.log2(linear / start) + 1e-9)))
