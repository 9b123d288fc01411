"""Timing device work honestly: wait for the device before reading the clock."""

import time


def seconds_per_step(step, carry, n: int):
    """Run `carry = step(carry)` n times; returns (carry, seconds per step) once the device is done."""
    import jax

    start = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return carry, (time.perf_counter() - start) / n


def synthetic_batch(cfg, setup) -> tuple[dict, dict]:
    """(this host's rows, the global batch as the step takes it) of one batch of synthetic tokens: timing
    only, any tokens will do, and the same batch every step keeps the data out of the measurement."""
    from trainer.data import streams

    synthetic = cfg.copy_and_resolve_references()
    synthetic.data.source = "synthetic"
    rows = range(cfg.train.global_batch_size)
    local = next(iter(streams.batches(streams.Stream.from_config(synthetic), "train", rows, shuffle=False)))
    return local, streams.to_global(local, setup.batch_sharding, cfg.train.global_batch_size)
