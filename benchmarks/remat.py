"""Rematerialisation policies side by side: step time and compiled memory per device.

    python benchmarks/remat.py --config configs/small.py [--steps 3] [--append]

Same model, batch and mesh for each policy in trainer/model/decoder.py's REMAT; the
step time is the median of `--steps` steps after one to compile, the memory
XLA's compiled total per device (trainer/planning/plan.py).
"""

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import step_seconds_and_memory  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per policy (after one to compile).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main():
    from trainer.model.decoder import REMAT

    figures = {"config": os.path.basename(cli.config_path())}
    for policy in REMAT:
        cfg = _CONFIG.value.copy_and_resolve_references()
        cfg.model.remat = policy
        seconds, memory = step_seconds_and_memory(cfg, _STEPS.value)
        figures[f"{policy}_step_s"] = seconds
        figures[f"{policy}_gib"] = memory / 2**30
    report("remat", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
