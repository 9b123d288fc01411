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


def step_seconds_and_memory(cfg, steps: int) -> tuple[float, int]:
    """The median of `steps` train steps after the one that compiles, and XLA's compiled total bytes per
    device (trainer/training/step.py memory_per_device), for a config on this process's devices."""
    import statistics

    import jax

    from trainer.training.setup import build
    from trainer.training.step import abstract_batch, memory_per_device

    setup = build(cfg)
    abstract = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, setup.batch_sharding)
    compiled = setup.train_step().lower(setup.abstract_state(), abstract).compile()
    _, batch = synthetic_batch(cfg, setup)
    state, times = setup.new_state(), []
    for i in range(steps + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), memory_per_device(compiled, setup.mesh.devices.flat[0].platform)["total"]


def pipeline_rate(cfg, batches: int) -> float:
    """Tokens per second of global batches read, packed and stacked, in this thread (one core)."""
    from trainer.data import streams

    rows = cfg.train.global_batch_size
    data = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(rows), shuffle=True))
    next(data)
    start = time.perf_counter()
    for _ in range(batches):
        next(data)
    return batches * rows * cfg.data.seq_len / (time.perf_counter() - start)
