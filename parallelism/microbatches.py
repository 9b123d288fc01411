"""Splitting a batch into microbatches that stay spread over the data-parallel devices.

Microbatch j of k takes rows j, j + k, j + 2k, ... of the batch. The batch's
rows are laid out over the data-parallel devices in contiguous blocks, so with
this strided choice every device's block holds a share of every microbatch:
each microbatch is computed by all devices, and splitting costs no
communication. Gradient accumulation (trainer/training/step.py) and the
pipeline's microbatches (parallelism/pipeline.py) both split this way.
"""

from __future__ import annotations

import jax


def split(x: jax.Array, k: int) -> jax.Array:
    """(k*m, ...) -> (k, m, ...): microbatch j is rows j, j + k, j + 2k, ..."""
    return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def join(x: jax.Array) -> jax.Array:
    """The inverse of `split`: (k, m, ...) -> (k*m, ...)."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
