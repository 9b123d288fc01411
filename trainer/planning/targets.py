"""Cloud TPU slices by the names users type (v5e-4, v5litepod-16, v5p-128, v4-8, v6e-256), and NVIDIA
GPU hosts (h100-8, h200-16), as devices their compilers can compile for on any machine, none present.

libtpu (the `tpu` extra) describes a slice from its topology name ("v5e:2x2",
"v5p:4x4x4"); JAX then lowers and compiles for its devices exactly as it would
on the pod. The accelerator type counts chips for v5e and v6e, TensorCores for
v4 and v5p, whose two cores per chip run as one device (megacore).

JAX's CUDA plugin (the `gpu` extra) compiles without a GPU or a driver when it
is given the topology (slices x hosts x GPUs per host) and a GpuTargetConfig:
the device's description, which `_gpu_target_config` writes from the data sheet.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from parallelism.accelerators import stderr_held_back
from parallelism.chips import CHIPS, Chip
from trainer.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Generation:
    chip: str  # key of parallelism.chips.CHIPS
    topology_prefix: str  # libtpu's name for the generation
    cores_per_chip: int  # what one unit of the accelerator type's number counts
    dims: int  # the torus: 2-D (v5e, v6e) or 3-D (v4, v5p)
    chip_counts: tuple[int, ...]  # the slice sizes Cloud TPU offers, in chips


_POWERS = tuple(2**k for k in range(13))
GENERATIONS = {
    "v4": Generation("tpu-v4", "v4", 2, 3, tuple(c for c in _POWERS if 4 <= c <= 2048)),
    "v5p": Generation("tpu-v5p", "v5p", 2, 3, tuple(c for c in _POWERS if 4 <= c <= 4096) + (6144,)),
    "v5e": Generation("tpu-v5e", "v5e", 1, 2, (1, 4, 8, 16, 32, 64, 128, 256)),
    "v6e": Generation("tpu-v6e", "v6e", 1, 2, (1, 4, 8, 16, 32, 64, 128, 256)),
}
ALIASES = {"v5litepod": "v5e"}
# GPU targets name their chip (parallelism/chips.py); 8 GPUs a host (an HGX board), or one host of N < 8.
GPUS = ("h100", "h200")
_GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user typed it
    generation: str
    chips: int
    topology: str  # libtpu's topology name, e.g. "v5e:2x2"; for GPUs slices x hosts x GPUs a host, "1x2x8"

    @property
    def chip(self) -> Chip:
        return CHIPS[self.chip_name]

    @property
    def chip_name(self) -> str:
        return self.generation if self.is_gpu else GENERATIONS[self.generation].chip

    @property
    def is_gpu(self) -> bool:
        return self.generation in GPUS


def known_targets() -> str:
    """One line per generation: the accelerator types it accepts."""
    lines = [f"{gpu}-N for N in {', '.join(map(str, _GPU_COUNTS))}" for gpu in GPUS]
    for name, g in GENERATIONS.items():
        sizes = [c * g.cores_per_chip for c in g.chip_counts]
        alias = next((a for a, target in ALIASES.items() if target == name), None)
        spelt = f"{name}-N" + (f" (or {alias}-N)" if alias else "")
        lines.append(f"{spelt} for N in {', '.join(map(str, sizes))}")
    return "; ".join(lines)


def topology_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The slice's torus as Cloud TPU lays it out: 2x2, 4x8, 16x16; 2x2x1, 2x2x4, 4x4x8, 16x16x24."""
    if chips == 6144:
        return (16, 16, 24)
    if dims == 3 and chips == 4:
        return (2, 2, 1)
    k = int(math.log2(chips))
    exponents = [k // dims + (1 if i >= dims - k % dims else 0) for i in range(dims)]
    return tuple(2**e for e in exponents)


def parse_target(text: str) -> Target:
    """'v5e-4' -> Target(generation 'v5e', 4 chips, topology 'v5e:2x2'); a clear error otherwise."""
    match = re.fullmatch(r"([a-z]?\d+[a-z]*)-(\d+)", text.strip().lower())
    if match and match.group(1) in GPUS and int(match.group(2)) in _GPU_COUNTS:
        gpus = int(match.group(2))
        hosts, per_host = max(1, gpus // 8), min(gpus, 8)
        return Target(text, match.group(1), gpus, f"1x{hosts}x{per_host}")
    generation = match and ALIASES.get(match.group(1), match.group(1))
    if not match or generation not in GENERATIONS:
        raise ConfigError(f"unknown target '{text}'; the known targets are: {known_targets()}.")
    g = GENERATIONS[generation]
    number = int(match.group(2))
    chips, left = divmod(number, g.cores_per_chip)
    if left or chips not in g.chip_counts:
        raise ConfigError(f"'{text}' is not a {generation} slice Cloud TPU offers; the known targets are: "
                          f"{known_targets()}.")  # fmt: skip
    shape = topology_shape(chips, g.dims)
    return Target(text, generation, chips, f"{g.topology_prefix}:{'x'.join(map(str, shape))}")


def installed(module: str) -> bool:
    """Whether a module can be imported; False too when its parent package is absent (find_spec raises)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _gpu_target_config(chip: Chip) -> str:
    """A GpuTargetConfig (protobuf text) for a Hopper GPU: what XLA's GPU compiler asks of the device.
    H100 SXM and H200 share the die (132 SMs, compute capability 9.0); memory and bandwidth differ."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 threads_per_core_limit: 2048
  shared_memory_per_block: 49152 shared_memory_per_block_optin: 232448 shared_memory_per_core: 233472
  core_count: 132 fpus_per_core: 128 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_per_second)} device_memory_size: {chip.hbm_bytes}
  l2_cache_size: 52428800 clock_rate_ghz: 1.98
  cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{chip.device_kinds[0]}"
"""


def _require(module: str, target: Target, compiler: str, extra: str) -> None:
    if not installed(module):
        raise ConfigError(f"--target {target.name} compiles with {compiler}; install it with: "
                          f"pip install -e \".[{extra}]\"")  # fmt: skip


def _gpu_devices(target: Target, slices: int) -> list:
    _require("jax_plugins.xla_cuda12", target, "XLA's GPU compiler, which comes with JAX's CUDA plugin", "gpu")
    # The plugin checks the CUDA runtime's version when it loads; compiling needs no runtime, and a
    # planning machine has none.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    shape = target.topology.split("x")
    topology = "x".join([str(slices), *shape[1:]])
    with stderr_held_back():  # the plugin's words on the CUDA it does not find
        found = topologies.get_topology_desc(platform="cuda", topology_name="", topology=topology,
                                             target_config=_gpu_target_config(target.chip))  # fmt: skip
    return list(found.devices)


def cudnn_missing() -> bool:
    """Whether cuDNN's library is absent from this machine: XLA:GPU then cannot compile cuDNN's fused attention
    (a CPU planning machine with the gpu extra, whose CUDA is the host's own, has none)."""
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    try:
        check_cudnn_version()
    except RuntimeError:
        return True
    return False


def check_kernel_compiles(cfg, target: Target) -> None:
    """A GPU target's cuDNN attention refused in one sentence where it cannot be compiled, before any compile."""
    from trainer.model.attention import resolve

    if target.is_gpu and resolve(cfg.model.attention, "cuda") == "cudnn" and cudnn_missing():
        raise ConfigError(f"compiling for {target.name} with cuDNN's fused attention (model.attention="
                          f"{cfg.model.attention}) needs cuDNN's library, which this machine lacks: plan with "
                          "--config.model.attention=xla here, or on a GPU host.")  # fmt: skip


def target_devices(target: Target, slices: int = 1) -> list:
    """The devices of `slices` such slices, for ahead-of-time compilation (no TPU or GPU needed)."""
    if slices < 1:
        raise ConfigError(f"--slices must be at least 1, not {slices}.")
    if target.is_gpu:
        return _gpu_devices(target, slices)
    _require("libtpu", target, "the TPU compiler, which comes with libtpu", "tpu")
    # libtpu takes a machine-wide lock file for the chips it drives; compiling drives none, and
    # without this a second planner (or a test beside one) fails to start.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    options = {"num_slices": slices}
    if target.chips == 1:
        options["chips_per_host_bounds"] = (1, 1, 1)  # a one-chip VM: the default host is 2x2x1
    if target.generation == "v4":
        options["chip_config_name"] = "megacore"  # one device per chip, as v4 VMs run
    with stderr_held_back():  # libtpu's warnings about the host it is not running on
        return list(topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **options).devices)
