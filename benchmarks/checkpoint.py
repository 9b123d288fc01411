"""Checkpoint cost: how long training is blocked by a save, the whole save, and a restore.

    python benchmarks/checkpoint.py --config configs/tiny.py [--repeats 3] [--append]

`blocked_s` is what the training loop waits for (`save()` returning: the copy
off the devices and the start of the write); `save_s` runs until the write is
complete; `restore_s` reads the full state back into its shardings. Medians of
`--repeats` runs, on the devices of this host (--simulate_devices for more).
"""

import os
import statistics
import sys
import tempfile
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from parallelism import accelerators  # noqa: E402
from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_REPEATS = flags.DEFINE_integer("repeats", 3, "Save/restore rounds; the median is reported.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 0, "Run on this many simulated CPU devices.")


def main():
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    import jax

    from trainer.model.flops import count_params
    from trainer.storage.checkpoint import Checkpointer
    from trainer.training.setup import build

    cfg = _CONFIG.value
    setup = build(cfg)
    state = setup.new_state()
    jax.block_until_ready(state)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    target = setup.abstract_state()
    blocked, total, restore = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(os.path.join(tmp, "checkpoints"), keep=2)
        for step in range(1, _REPEATS.value + 1):
            start = time.perf_counter()
            ckpt.save(step, state, None)
            blocked.append(time.perf_counter() - start)
            ckpt.wait()
            total.append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(ckpt.restore(step, target.params, target.opt_state, None))
            restore.append(time.perf_counter() - start)
        ckpt.close()
    report(
        "checkpoint",
        {
            "config": os.path.basename(cli.config_path()),
            "params": count_params(setup.model.abstract_params)["total"],
            "state_gb": state_bytes / 1e9,
            "devices": setup.mesh.size,
            "blocked_s": statistics.median(blocked),
            "save_s": statistics.median(total),
            "restore_s": statistics.median(restore),
        },
        append=_APPEND.value,
    )


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
