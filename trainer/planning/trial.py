"""Timing a layout on this machine's devices: plan.py --search --trial's measurement, and the benchmarks'.

A trial times real steps after the one that compiles, on a batch of synthetic tokens made once (the data
pipeline kept out of the measurement), waiting for the devices before reading the clock.
"""

from __future__ import annotations

import statistics
import time


def synthetic_batch(cfg, setup) -> tuple[dict, dict]:
    """(this host's rows, the global batch as the step takes it) of one batch of synthetic tokens: timing
    only, any tokens will do, and the same batch every step keeps the data out of the measurement."""
    from trainer.data import streams

    synthetic = cfg.copy_and_resolve_references()
    synthetic.data.source = "synthetic"
    rows = range(cfg.train.global_batch_size)
    local = next(iter(streams.batches(streams.Stream.from_config(synthetic), "train", rows, shuffle=False)))
    return local, streams.to_global(local, setup.batch_sharding, cfg.train.global_batch_size)


def step_seconds(setup, steps: int) -> float:
    """The median of `steps` train steps of a fresh state after the one that compiles, on this process's
    devices (the setup's mesh)."""
    import jax

    _, batch = synthetic_batch(setup.cfg, setup)
    step, state, times = setup.train_step(), setup.new_state(), []
    for i in range(steps + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
