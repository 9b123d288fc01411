"""What each accelerator chip offers, from its vendor's data sheet: peak, memory, memory bandwidth.

The planner divides by these (MFU, time to train, the roofline lower bound on a
step, whether a step fits in HBM). Per chip, i.e. per JAX device: v4 and v5p
chips run their two TensorCores as one device (megacore).
"""

from __future__ import annotations

import dataclasses
import os

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    device_kinds: tuple[str, ...]  # jax's Device.device_kind for it, exactly (the first: what GPU targets describe)
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_second: float
    # What a program may hold: on TPUs the "available HBM" XLA:TPU (libtpu 0.0.42.1) states when it refuses
    # a step, the runtime keeping the rest. None for GPUs: what JAX's allocator lets a process hold
    # (gpu_memory_share).
    usable_bytes: int | None = None
    # Dense int8 and fp8 matmul rates, ops/s, from the same data sheets (0: no such units); quantised
    # training's dots (trainer/model/low_precision.py) run at these in the planner's roofline.
    int8_ops: float = 0.0
    fp8_ops: float = 0.0
    # What one device sends per second in a collective over one mesh axis (plan.py --search's cost model,
    # trainer/planning/cost.py). A TPU's data sheet gives the chip's bidirectional ICI bandwidth over all its
    # ports (4 on a 2-D torus, 6 on a 3-D one); a ring along one torus axis sends on that axis's two links,
    # one way each: the figure over the ports. A GPU sends at its NVLink bandwidth one way within a host.
    ici_bytes_per_second: float = 0.0
    # Between slices (TPU) or hosts (GPU): the data-centre network's share of one chip, from the same sheets.
    dcn_bytes_per_second: float = 0.0

    @property
    def usable_hbm_bytes(self) -> int:
        return self.usable_bytes or int(self.hbm_bytes * gpu_memory_share()[0])


# Named by the exact device kinds: a substring would give an H100 PCIe (or NVL) the SXM's peak. A kind that
# is not here has no known peak (MFU is then not reported) rather than a wrong one.
# fmt: off
CHIPS = {
    # ICI: 800 GB/s bidirectional over 4 ports. DCN: the sheet gives none; v5e's 25 Gbps a chip is taken.
    "tpu-v6e": Chip(("TPU v6 lite",), 918e12, 32 * GiB, 1640e9, int(31.25 * GiB), int8_ops=1836e12,
                    ici_bytes_per_second=200e9, dcn_bytes_per_second=3.125e9),
    # ICI: 400 GB/s bidirectional over 4 ports; DCN: 6.4 Tbps a pod of 256 chips (2 x 100 Gbps a host of 8).
    "tpu-v5e": Chip(("TPU v5 lite",), 197e12, 16 * GiB, 819e9, int(15.75 * GiB), int8_ops=394e12,
                    ici_bytes_per_second=100e9, dcn_bytes_per_second=3.125e9),
    # The data sheet's "95 GB" is rounded down: XLA:TPU offers a program 95.74 GiB. ICI: 1200 GB/s
    # bidirectional over 6 ports; DCN: 50 Gbps a chip.
    "tpu-v5p": Chip(("TPU v5",), 459e12, 96 * GiB, 2765e9, int(95.74 * GiB), int8_ops=918e12,
                    ici_bytes_per_second=200e9, dcn_bytes_per_second=6.25e9),
    # ICI: 2400 Gbps (300 GB/s) over 6 ports; DCN: not on the sheet, v5p's 50 Gbps a chip taken.
    "tpu-v4": Chip(("TPU v4",), 275e12, 32 * GiB, 1228e9, int(30.75 * GiB), int8_ops=275e12,
                   ici_bytes_per_second=50e9, dcn_bytes_per_second=6.25e9),
    # NVLink 4: 900 GB/s bidirectional, 450 one way; between hosts one 400 Gb/s InfiniBand NIC a GPU.
    "h200": Chip(("NVIDIA H200",), 989e12, 141 * 10**9, 4.8e12, int8_ops=1979e12, fp8_ops=1979e12,
                 ici_bytes_per_second=450e9, dcn_bytes_per_second=50e9),
    "h100": Chip(("NVIDIA H100 80GB HBM3",), 989e12, 80 * 10**9, 3.35e12, int8_ops=1979e12, fp8_ops=1979e12,
                 ici_bytes_per_second=450e9, dcn_bytes_per_second=50e9),  # SXM
    # NVLink bridges pair PCIe cards (600 GB/s bidirectional); the rest is PCIe 5 (64 GB/s one way).
    "h100-pcie": Chip(("NVIDIA H100 PCIe",), 756e12, 80 * 10**9, 2.0e12, int8_ops=1513e12, fp8_ops=1513e12,
                      ici_bytes_per_second=64e9, dcn_bytes_per_second=50e9),
    # NVLink 3: 600 GB/s bidirectional; 200 Gb/s HDR InfiniBand a GPU.
    "a100": Chip(("NVIDIA A100-SXM4-80GB",), 312e12, 80 * 10**9, 2.039e12, int8_ops=624e12,
                 ici_bytes_per_second=300e9, dcn_bytes_per_second=25e9),
    "a100-40gb": Chip(("NVIDIA A100-SXM4-40GB",), 312e12, 40 * 10**9, 1.555e12, int8_ops=624e12,
                      ici_bytes_per_second=300e9, dcn_bytes_per_second=25e9),
}
# fmt: on


def chip_of(device_kind: str) -> str | None:
    """The planner's name for a device kind, None for one the table does not know."""
    return next((name for name, chip in CHIPS.items() if device_kind in chip.device_kinds), None)


def gpu_memory_share(environ=os.environ) -> tuple[float, str]:
    """(share of a GPU's memory that JAX's allocator lets one process hold, why), read from the variables
    jaxlib reads (jaxlib/xla_client.py): XLA_CLIENT_MEM_FRACTION (or the older XLA_PYTHON_CLIENT_MEM_FRACTION),
    0.75 when neither is set; preallocating or not (XLA_PYTHON_CLIENT_PREALLOCATE) does not change the
    limit; XLA_PYTHON_CLIENT_ALLOCATOR=platform allocates from the whole memory."""
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0, "all of it (XLA_PYTHON_CLIENT_ALLOCATOR=platform)"
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        if environ.get(name):
            return float(environ[name]), f"{name}={environ[name]}"
    return 0.75, "JAX's allocator takes 75% unless XLA_CLIENT_MEM_FRACTION says otherwise"
