"""How many sequences each step reads: the global batch, or less early on (a batch-size ramp).

Early in training small batches are as good per token as large ones and cost
fewer tokens per update. With `train.ramp_batch_size` > 0 the batch grows in
powers of two from that size to `global_batch_size` over `train.ramp_tokens`
tokens (a stage is the largest power-of-two multiple of the start not above
the linear target). The learning-rate schedule counts sequences, so the ramp
does not move it: step s of the schedule is always s full batches' worth.

Sizes follow the sequences read from the data stream, so the loop can read
batches ahead (a skipped step reads data too). A run reads exactly
`train.steps` global batches' worth of sequences unless steps are skipped; the
last steps of a ramped run take what is left, in halves of a stage, so every
step's size divides the global batch (see streams.ramp_rows).
"""

from __future__ import annotations

import math

from trainer.config import microbatch_size
from trainer.config.errors import ConfigError


def check(cfg) -> None:
    t = cfg.train
    if not t.ramp_batch_size:
        return
    micro, ratio = microbatch_size(cfg), t.global_batch_size / t.ramp_batch_size
    if (
        t.ramp_batch_size % micro
        or not micro <= t.ramp_batch_size < t.global_batch_size
        or ratio != 2 ** round(math.log2(ratio))
    ):
        raise ConfigError(
            f"train.ramp_batch_size={t.ramp_batch_size} must be a multiple of the microbatch ({micro} sequences) "
            f"and train.global_batch_size={t.global_batch_size} divided by a power of two."
        )
    if t.ramp_tokens <= 0:
        raise ConfigError("train.ramp_tokens must be positive when train.ramp_batch_size is set.")


def step_size(cfg, read: int) -> int:
    """Sequences the next step reads, given how many sequences have been read from the stream."""
    t = cfg.train
    size = t.global_batch_size
    if t.ramp_batch_size:
        start = t.ramp_batch_size
        ramp = t.ramp_tokens / cfg.data.seq_len  # in sequences
        linear = start + (size - start) * min(1.0, read / ramp)
        size = min(size, start * 2 ** int(math.floor(math.log2(linear / start) + 1e-9)))
    left = t.steps * t.global_batch_size - read
    while size > left > 0:
        size //= 2
    return size
