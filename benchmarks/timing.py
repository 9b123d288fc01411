"""Timing device work honestly: wait for the device before reading the clock."""

import time

from trainer.planning.trial import synthetic_batch  # noqa: F401 (the benchmarks import it from here)


def seconds_per_step(step, carry, n: int):
    """Run `carry = step(carry)` n times; returns (carry, seconds per step) once the device is done."""
    import jax

    start = time.perf_counter()
    for _ in range(n):
        carry = step(carry)
    jax.block_until_ready(carry)
    return carry, (time.perf_counter() - start) / n


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
