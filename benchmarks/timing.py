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
