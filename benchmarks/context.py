"""Context parallelism: memory per device and step time against sequence length, at each context size.

    python benchmarks/context.py --config configs/tiny.py --seq_lens 1024,2048,4096 --contexts 1,2,4 \
        --simulate_devices 8 [--steps 2] [--append]

One sequence per data-parallel group: the mesh is context=C x fsdp=devices/C and the global batch
devices/C sequences, so a device holds seq/C of one sequence's tokens at every C. At C=1 attention
is `model.attention` (xla on a CPU: the whole (heads, seq, seq) scores); above, `model.context_attention`
over the axis (trainer/model/context.py: its queries x 512 keys at a time). The memory is XLA's compiled
total per device (trainer/training/step.py memory_per_device), the step time the median of `--steps`
steps after the compile.
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
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096"], "Sequence lengths to measure.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1", "2", "4"], "Context axis sizes to measure.")
_STEPS = flags.DEFINE_integer("steps", 2, "Timed steps per cell (after one to compile).")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 8, "Simulated CPU devices (0 = the real ones).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main():
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    import jax

    devices = jax.device_count()
    figures = {"config": os.path.basename(cli.config_path()), "devices": devices}
    for seq in map(int, _SEQ_LENS.value):
        for context in map(int, _CONTEXTS.value):
            cfg = _CONFIG.value.copy_and_resolve_references()
            cfg.data.seq_len = cfg.model.max_seq_len = seq
            cfg.mesh.update(data=1, context=context, fsdp=devices // context, tensor=1, stage=1)
            cfg.train.update(global_batch_size=devices // context, grad_accum_steps=1)
            seconds, memory = step_seconds_and_memory(cfg, _STEPS.value)
            figures[f"seq{seq}_context{context}_step_s"] = seconds
            figures[f"seq{seq}_context{context}_mib"] = memory / 2**20
    report("context", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
