"""A Gated DeltaNet layer against a full-attention layer of the same width, forward and backward, as the
sequence grows: time on this machine's CPU, and XLA:TPU's compiled roofline for a TPU chip.

    python benchmarks/linear_attention.py [--seq_lens=2048,8192,32768] [--cpu_max=16384] [--steps=2] \
        [--target=v5e-1] [--append]

Each variant is a model of one layer of that kind (trainer/model/delta.py, or Qwen3.5's gated attention with
a quarter of each head rotated), its MLP 8 wide and its vocabulary 256, so that the layer is nearly all of
the step; one sequence a step.
CPU: width 256 (attention: 2 heads of 128 on 2 key/value heads; DeltaNet: 2 key heads of 64 serving 4 value
heads of 64), fp32, xla attention (its scores whole): the median of --steps train steps after the one that
compiles. Attention past --cpu_max tokens is not run: its scores alone are heads x seq^2 x 4 bytes (8.6 GB
at 32k) and would not fit beside the backward pass in this VM's 24 GB.
TPU: Qwen3.5-9B's width (attention: 16 heads of 256 on 4; DeltaNet: 16 key heads of 128 serving 32 value
heads of 128), bf16, the TPU's attention kernel (splash), full rematerialisation (attention at 32k without
it needs an 18.5 GiB heap, over a v5e's 15.75), compiled for --target by scripts/plan.py's compile: the
step's FLOPs from the compiled HLO, its roofline and its heap.
"""

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import step_seconds_and_memory  # noqa: E402

from trainer.run import cli  # noqa: E402

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["2048", "8192", "32768"], "Tokens a sequence.")
_CPU_MAX = flags.DEFINE_integer("cpu_max", 16384, "The longest sequence full attention runs at on the CPU.")
_STEPS = flags.DEFINE_integer("steps", 2, "Timed steps per variant on the CPU (after one to compile).")
_TARGET = flags.DEFINE_string("target", "v5e-1", "TPU slice to compile for ('' = none: zeros).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")

KINDS = {"linear": "linear_attention", "full": "full_attention"}
COMMON = {"model.n_layers": 1, "model.d_ff": 8, "model.vocab_size": 256, "model.qk_norm": True,
          "model.attention_gate": True, "model.centred_norms": True, "model.rope_fraction": 0.25,
          "model.loss_chunk": 0, "data.source": "synthetic", "data.tokenizer": "byte",
          "train.global_batch_size": 1, "train.grad_accum_steps": 1, "mesh.data": 1, "mesh.fsdp": -1,
          "mesh.tensor": 1}  # fmt: skip
CPU = {"model.d_model": 256, "model.n_heads": 2, "model.n_kv_heads": 2, "model.head_dim": 128,
       "model.linear.key_heads": 2, "model.linear.value_heads": 4, "model.linear.key_dim": 64,
       "model.linear.value_dim": 64, "precision.compute_dtype": "float32", "model.attention": "xla"}  # fmt: skip
TPU = {"model.d_model": 4096, "model.n_heads": 16, "model.n_kv_heads": 4, "model.head_dim": 256,
       "model.linear.key_heads": 16, "model.linear.value_heads": 32, "model.linear.key_dim": 128,
       "model.linear.value_dim": 128, "precision.compute_dtype": "bfloat16", "model.attention": "auto",
       "model.remat": "full"}  # fmt: skip


def config(kind: str, seq_len: int, shape: dict):
    from trainer.config import defaults
    from trainer.config.forms import with_changes

    return with_changes(defaults(), {**COMMON, **shape, "model.layer_types": (KINDS[kind],),
                                     "data.seq_len": seq_len, "model.max_seq_len": seq_len})  # fmt: skip


def main():
    import jax

    from parallelism import accelerators

    jax.config.update("jax_platforms", "cpu")  # as scripts/plan.py: a target's libtpu descriptions, not this host
    accelerators.simulate_devices(1)
    accelerators.start()
    from trainer.planning.plan import plan

    figures = {"target": _TARGET.value or "none"}
    for seq in (int(s) for s in _SEQ_LENS.value):
        for kind in KINDS:
            if kind == "full" and seq > _CPU_MAX.value:
                seconds = 0.0  # not run: see the docstring
            else:
                seconds = step_seconds_and_memory(config(kind, seq, CPU), _STEPS.value)[0]
            figures[f"cpu_{kind}_{seq}_s"] = seconds
            result = plan(config(kind, seq, TPU), target=_TARGET.value) if _TARGET.value else {}
            cost = result.get("cost", {})  # none where the compile did not fit: its heap says by how much
            figures[f"tpu_{kind}_{seq}_flops"] = cost.get("flops", 0.0)
            figures[f"tpu_{kind}_{seq}_roofline_s"] = cost.get("roofline_seconds", 0.0)
            figures[f"tpu_{kind}_{seq}_gib"] = result.get("compiled_bytes_per_device", 0) / 2**30
    report("linear_attention", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
