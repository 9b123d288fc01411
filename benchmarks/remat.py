"""Rematerialisation policies side by side: step time and compiled memory per device.

    python benchmarks/remat.py --config configs/small.py [--steps 3] [--append]

Same model, batch and mesh for each policy in trainer/model/decoder.py's REMAT; the
step time is the median of `--steps` steps after one to compile, the memory
XLA's compiled total per device (trainer/planning/plan.py).
"""

import os
import statistics
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import synthetic_batch  # noqa: E402

from trainer import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per policy (after one to compile).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def measure(cfg) -> tuple[float, int]:
    import jax

    from trainer.training.setup import build
    from trainer.training.step import abstract_batch, memory_per_device

    setup = build(cfg)
    abstract = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, setup.batch_sharding)
    compiled = setup.train_step().lower(setup.abstract_state(), abstract).compile()
    _, batch = synthetic_batch(cfg, setup)
    state, times = setup.new_state(), []
    for i in range(_STEPS.value + 1):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), memory_per_device(compiled, setup.mesh.devices.flat[0].platform)["total"]


def main():
    from trainer.model.decoder import REMAT

    figures = {"config": os.path.basename(cli.config_path())}
    for policy in REMAT:
        cfg = _CONFIG.value.copy_and_resolve_references()
        cfg.model.remat = policy
        seconds, memory = measure(cfg)
        figures[f"{policy}_step_s"] = seconds
        figures[f"{policy}_gib"] = memory / 2**30
    report("remat", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
