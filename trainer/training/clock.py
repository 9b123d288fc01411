"""Counts of sequences that do not wrap: the schedule's clock and the data stream's position.

A device integer is 32 bits (JAX runs without x64), and 2^31 sequences (4.4T
tokens at 2048 a sequence; Llama 3 saw 15T) is within a long run's reach: an
int32 count wrapped negative there, the schedule took its warmup branch and the
run never finished. So a count is two int32s: the global batches completed and
the rows of the one begun, value = batches * global_batch_size + rows with
0 <= rows < global_batch_size. It is exact for any run of fewer than 2^31
global batches (the step counter's own limit), 2^53 tokens and more at any
batch of 4M tokens or above, and the schedule reads it as batches + rows /
global_batch_size, the global batches trained on, directly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def zero() -> dict:
    return {"batches": jnp.int32(0), "rows": jnp.int32(0)}


def add(count: dict, rows, batch: int) -> dict:
    """`count` plus `rows` sequences (at most one global batch of `batch`), on the device."""
    total = count["rows"] + rows
    return {"batches": count["batches"] + total // batch, "rows": total % batch}


def in_batches(count: dict, batch: int):
    """The count in global batches, a float32 (the schedule's argument)."""
    return count["batches"].astype(jnp.float32) + count["rows"].astype(jnp.float32) / batch


def value(count: dict, batch: int) -> int:
    """The exact count of sequences, on the host."""
    return int(np.asarray(count["batches"])) * batch + int(np.asarray(count["rows"]))


def of(sequences: int, batch: int) -> dict:
    """The two words of `sequences`, for a batch of `batch` (host arrays)."""
    batches, rows = divmod(int(sequences), batch)
    if batches >= 2**31:
        raise OverflowError(f"{sequences} sequences are 2^31 or more global batches of {batch}")
    return {"batches": np.int32(batches), "rows": np.int32(rows)}
