"""What each accelerator chip offers, from its vendor's data sheet: peak, memory, memory bandwidth.

The planner divides by these (MFU, time to train, the roofline lower bound on a
step, whether a step fits in HBM). Per chip, i.e. per JAX device: v4 and v5p
chips run their two TensorCores as one device (megacore).
"""

from __future__ import annotations

import dataclasses

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    device_kind: str  # what jax's Device.device_kind contains
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_second: float
    # What a program may hold: on TPUs the "available HBM" XLA:TPU (libtpu 0.0.42.1) states when it refuses
    # a step, the runtime keeping the rest. None: the whole HBM (GPUs: not measured; note JAX's allocator
    # takes 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise).
    usable_bytes: int | None = None

    @property
    def usable_hbm_bytes(self) -> int:
        return self.usable_bytes or self.hbm_bytes


# Matched against device_kind in this order: v5p reports itself as "TPU v5", so it
# must come after v5e's "TPU v5 lite"; v6e is "TPU v6 lite".
CHIPS = {
    "tpu-v6e": Chip("TPU v6", 918e12, 32 * GiB, 1640e9, int(31.25 * GiB)),
    "tpu-v5e": Chip("TPU v5 lite", 197e12, 16 * GiB, 819e9, int(15.75 * GiB)),
    # The data sheet's "95 GB" is rounded down: XLA:TPU offers a program 95.74 GiB.
    "tpu-v5p": Chip("TPU v5", 459e12, 96 * GiB, 2765e9, int(95.74 * GiB)),
    "tpu-v4": Chip("TPU v4", 275e12, 32 * GiB, 1228e9, int(30.75 * GiB)),
    "h200": Chip("H200", 989e12, 141 * 10**9, 4.8e12),
    "h100": Chip("H100", 989e12, 80 * 10**9, 3.35e12),  # SXM
    "a100": Chip("A100", 312e12, 80 * 10**9, 2.039e12),  # SXM, 80 GB
}


def chip_of(device_kind: str) -> str | None:
    """The planner's name for a device kind, None for one the table does not know."""
    return next((name for name, chip in CHIPS.items() if chip.device_kind in device_kind), None)
