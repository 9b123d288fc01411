"""Gemma 3's local and global layers (five local to one global) against all-global layers at 8192 tokens:
step time and memory on simulated CPU devices, and the TPU compile's roofline.

    python benchmarks/sliding_window.py --config configs/gemma3_1b.py --simulate_devices 8 \
        [--steps 2] [--target v5e-8] [--append]

CPU: the config's layers and window at a width a CPU steps at 8192 tokens in seconds (d_model 256, one
unit of five local layers and a global one, 2 heads of 64 on 2 key/value heads, GeGLU 1024, a 4096-token
vocabulary), on fsdp 4 x tensor 2 (a head and a sequence a device), xla attention: a local layer's
attention in chunks of the window (trainer/model/attention.py `local_attention`), a global layer's
whole (heads, seq, seq) scores. Both variants compiled, then timed: the median of `--steps` steps
after one, and XLA's compiled total bytes per device.
TPU: the config itself, compiled through libtpu for `--target` (scripts/plan.py's compile), with and
without its window: the step's FLOPs and HBM bytes from the compiled HLO (the splash calls counted by
the blocks their masks run), its roofline, and the compiled heap per device.
"""

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import step_seconds_and_memory  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 2, "Timed steps per variant (after one to compile).")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 8, "Simulated CPU devices (0 = the real ones).")
_TARGET = flags.DEFINE_string("target", "v5e-8", "TPU slice to compile the config for ('' = none: zeros).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 8192, "Tokens a sequence on the CPU.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")

GLOBAL = {"model.sliding_window": 0, "model.global_every": 0, "model.local_rope_theta": 0.0}
CPU_SHAPE = {"model.d_model": 256, "model.n_layers": 6, "model.n_heads": 2, "model.n_kv_heads": 2,
             "model.head_dim": 64, "model.d_ff": 1024, "model.vocab_size": 4096,
             "data.tokenizer": "byte", "data.source": "synthetic", "precision.compute_dtype": "float32",
             "model.attention": "xla", "model.loss_chunk": 0, "mesh.fsdp": 4, "mesh.tensor": 2,
             "train.global_batch_size": 4, "train.grad_accum_steps": 1}  # fmt: skip


def main():
    import jax

    from parallelism import accelerators

    # As scripts/plan.py: the CPU's simulated devices, and a target's libtpu descriptions, never this machine's own
    jax.config.update("jax_platforms", "cpu")
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    accelerators.start()
    from trainer.config.forms import with_changes
    from trainer.planning.plan import plan

    base = _CONFIG.value
    figures = {"config": os.path.basename(cli.config_path()), "window": base.model.sliding_window,
               "global_every": base.model.global_every, "cpu_devices": jax.device_count(),
               "cpu_seq_len": _SEQ_LEN.value}  # fmt: skip
    for name, changes in (("local", {}), ("global", GLOBAL)):
        cpu = {**CPU_SHAPE, "data.seq_len": _SEQ_LEN.value, **changes}
        seconds, memory = step_seconds_and_memory(with_changes(base, cpu), _STEPS.value)
        figures.update({f"cpu_{name}_step_s": seconds, f"cpu_{name}_gib": memory / 2**30})
    figures["cpu_step_ratio"] = figures["cpu_local_step_s"] / figures["cpu_global_step_s"]
    figures["target"] = _TARGET.value or "none"
    for name, changes in (("local", {}), ("global", GLOBAL)):
        result = plan(with_changes(base, changes), target=_TARGET.value) if _TARGET.value else {}
        cost = result.get("cost", {})
        figures.update({f"tpu_{name}_flops": cost.get("flops", 0.0), f"tpu_{name}_hbm_gb": cost.get(
            "bytes_accessed", 0.0) / 1e9, f"tpu_{name}_roofline_s": cost.get("roofline_seconds", 0.0),
            f"tpu_{name}_heap_gib": result.get("compiled_bytes_per_device", 0) / 2**30})  # fmt: skip
    figures["tpu_roofline_ratio"] = figures["tpu_local_roofline_s"] / max(figures["tpu_global_roofline_s"], 1e-9)
    report("sliding_window", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
