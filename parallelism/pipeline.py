"""Pipeline parallelism: the stacked layers split into stages over the 'stage' mesh axis.

The GPipe schedule written as one SPMD program. The layers' stacked weights
(layers, ...) are viewed as (stages, layers_per_stage, ...); with the 'layers'
logical axis placed on the 'stage' mesh axis, each device group holds one
contiguous block of layers, so the view costs no communication and checkpoints
keep the stage-free (layers, ...) layout.

A buffer holds one microbatch per stage. Each tick shifts the buffer one stage
along (stage s takes what stage s-1 produced: a collective permute between
neighbours), feeds the next microbatch to stage 0, and runs every stage at once
(`vmap` over the stage axis, which the mesh splits). After M + S - 1 ticks all
M microbatches have left the last stage. Differentiating the tick loop gives
all forwards, then all backwards: GPipe. Stage s idles (computes on padding)
for S - 1 of the M + S - 1 ticks, the bubble (S - 1) / (M + S - 1).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from parallelism.microbatches import join as microbatch_join
from parallelism.microbatches import split as microbatch_split
from parallelism.rules import LogicalSharding

STAGE_AXIS = "stage"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of each stage's ticks spent idle under GPipe: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def split_stages(stacked, stages: int):
    """(layers, ...) -> (stages, layers / stages, ...): stage s holds a contiguous block of layers."""
    return jax.tree.map(lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), stacked)


def _shift(buffer: jax.Array, incoming: jax.Array) -> jax.Array:
    # A rotation written as concatenated slices, which XLA's SPMD partitioner
    # turns into one collective permute between neighbouring stages; stage 0
    # then selects the new microbatch elementwise, with no resharding.
    rotated = jnp.concatenate([buffer[-1:], buffer[:-1]], axis=0)
    first = (jnp.arange(buffer.shape[0]) == 0).reshape(-1, *(1,) * (buffer.ndim - 1))
    return jnp.where(first, incoming[None], rotated)


def gpipe(
    stage_fn: Callable,
    stage_params,
    inputs: dict[str, jax.Array],
    *,
    stages: int,
    microbatches: int,
    shard: LogicalSharding,
) -> jax.Array:
    """Run `stage_fn` as a pipeline over `stages` and return the last stage's output.

    `stage_fn(params, mb)` runs one stage's layers on one microbatch, where
    `params` is one stage's slice of `stage_params` (leading axis `stages`) and
    `mb` is a dict of one microbatch's arrays; it returns the new `mb["x"]`.
    `inputs` holds arrays with a leading batch axis; every entry travels with
    its microbatch, only "x" is transformed. Microbatches are split as
    parallelism/microbatches.py says, so that each stays split over the data
    axes like the batch.
    """
    batch = inputs["x"].shape[0]
    if batch % microbatches:
        raise ValueError(f"a batch of {batch} does not split into {microbatches} pipeline microbatches")

    def constrain(a, leading):
        return shard.constrain(a, (leading, "batch") + (None,) * (a.ndim - 2))

    def split(a):
        mbs = microbatch_split(a, microbatches)
        # S - 1 ticks of padding drain the pipeline; zeros keep the idle stages finite.
        return constrain(jnp.concatenate([mbs, jnp.zeros((stages - 1, *mbs.shape[1:]), a.dtype)]), None)

    feed = {k: split(v) for k, v in inputs.items()}
    buffer = {k: constrain(jnp.zeros((stages, *v.shape[1:]), v.dtype), "stages") for k, v in feed.items()}

    def run_stage(params, mb):
        return {**mb, "x": stage_fn(params, mb)}

    # spmd_axis_name: sharding constraints inside the stage keep the stage axis split.
    run_all = jax.vmap(run_stage, spmd_axis_name=STAGE_AXIS)

    def tick(buffer, incoming):
        buffer = {k: constrain(_shift(buffer[k], incoming[k]), "stages") for k in buffer}
        buffer = run_all(stage_params, buffer)
        buffer = {k: constrain(v, "stages") for k, v in buffer.items()}
        # Every stage's output stays where it is; taking only the last stage's
        # here would broadcast it to all stages on every tick.
        return buffer, buffer["x"]

    _, outputs = jax.lax.scan(tick, buffer, feed)
    # Microbatch i leaves the last stage at tick i + S - 1.
    return microbatch_join(outputs[stages - 1 :, -1])
