"""Mixture of experts: step time of an MoE config against the dense model with its active parameters.

    python benchmarks/moe.py --config configs/moe_tiny.py --experts 1,4 --simulate_devices 8 \
        [--steps 3] [--append]

On `--simulate_devices` CPU devices, one train step of the config's global batch: the dense model (each
layer's MLP model.moe.experts_per_token x model.moe.d_ff wide, so a token meets as many weights), then
the MoE model at each expert axis size (mesh.expert=E, fsdp the rest of the devices), dropless and
capacity-bound (model.moe.capacity_factor). The step time is the median of `--steps` steps after the
compile; the memory XLA's compiled total per device (trainer/training/step.py memory_per_device).
"""

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import step_seconds_and_memory  # noqa: E402

from parallelism import accelerators  # noqa: E402
from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_EXPERTS = flags.DEFINE_list("experts", ["1", "4"], "Expert axis sizes to measure.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per cell (after one to compile).")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 8, "Simulated CPU devices (0 = the real ones).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main():
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    import jax

    devices = jax.device_count()
    base = _CONFIG.value.copy_and_resolve_references()
    m = base.model.moe
    if not m.num_experts:
        raise SystemExit("--config has no experts (model.moe.num_experts=0); give an MoE config.")
    figures = {"config": os.path.basename(cli.config_path()), "devices": devices, "experts": m.num_experts,
               "experts_per_token": m.experts_per_token}  # fmt: skip
    dense = base.copy_and_resolve_references()
    dense.model.d_ff = m.experts_per_token * (m.d_ff or base.model.d_ff)
    dense.model.moe.num_experts = 0
    dense.mesh.update(data=1, fsdp=devices, expert=1, tensor=1, stage=1)
    figures["dense_step_s"], memory = step_seconds_and_memory(dense, _STEPS.value)
    figures["dense_mib"] = memory / 2**20
    for expert in map(int, _EXPERTS.value):
        for impl in ("dropless", "capacity"):
            cfg = base.copy_and_resolve_references()
            cfg.model.moe.impl = impl
            cfg.mesh.update(data=1, fsdp=devices // expert, expert=expert, tensor=1, stage=1)
            seconds, memory = step_seconds_and_memory(cfg, _STEPS.value)
            figures[f"expert{expert}_{impl}_step_s"] = seconds
            figures[f"expert{expert}_{impl}_mib"] = memory / 2**20
    report("moe", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
