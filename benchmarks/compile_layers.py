"""Compile time against depth: the layer scan should keep it flat, unrolled layers should not.

    python benchmarks/compile_layers.py --config configs/tiny.py [--layers 2,4,8,16] [--append]

Each point lowers and compiles the full train step ahead of time (abstract
inputs, nothing allocated) with `model.scan_layers` on and off; figures are
seconds per compile.
"""

import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_LAYERS = flags.DEFINE_list("layers", ["2", "4", "8", "16"], "Layer counts to compile.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def compile_seconds(cfg) -> float:
    import jax

    from trainer.training.setup import build
    from trainer.training.step import abstract_batch

    setup = build(cfg, jax.devices()[:1])
    start = time.perf_counter()
    batch = abstract_batch(cfg.train.global_batch_size, cfg.data.seq_len, setup.batch_sharding)
    setup.train_step().lower(setup.abstract_state(), batch).compile()
    return time.perf_counter() - start


def main():
    base = _CONFIG.value
    base.mesh.update(dict(data=1, fsdp=1, tensor=1))
    figures = {"config": os.path.basename(cli.config_path())}
    for layers in (int(x) for x in _LAYERS.value):
        for scan in (True, False):
            cfg = base.copy_and_resolve_references()
            cfg.model.update(dict(n_layers=layers, scan_layers=scan))
            figures[f"{'scan' if scan else 'unrolled'}_{layers}_s"] = compile_seconds(cfg)
    report("compile_layers", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
