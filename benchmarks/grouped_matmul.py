"""The dropless experts' grouped matmul on a TPU, compiled: jax.lax.ragged_dot against megablox's kernel.

    pip install -e ".[tpu]" && python benchmarks/grouped_matmul.py --target v5p-8 [--rows 32768] \
        [--d_model 2048] [--d_ff 1024] [--experts 8] [--append]

One device's share of one expert matmul (its `--experts` local experts, each `--d_model` x `--d_ff`, over
`--rows` copies sorted by expert; the defaults are configs/moe_1b.py's at mesh.expert=8: 4,096 tokens a
microbatch per device, top 8), its forward and its backward (the input's and the weights' gradients),
compiled for one chip of `--target` through libtpu (no TPU needed). What the compiled HLO computes, in
FLOPs (XLA's matmuls, and each kernel by the cost estimate it carries: trainer/planning/plan.py
kernel_cost), against the useful 2 x rows x d_model x d_ff per matmul; and XLA's temporary buffers.
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402

_TARGET = flags.DEFINE_string("target", "v5p-8", "A TPU slice (scripts/plan.py's names); one chip of it is used.")
_ROWS = flags.DEFINE_integer("rows", 32768, "Copies of tokens a device's experts take (tokens x top-k).")
_D_MODEL = flags.DEFINE_integer("d_model", 2048, "Model width.")
_D_FF = flags.DEFINE_integer("d_ff", 1024, "Each expert's MLP width.")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts on the device (model.moe.num_experts / mesh.expert).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def main(_):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    from parallelism import hlo
    from trainer.model.moe import grouped_matmul
    from trainer.planning.plan import kernel_cost
    from trainer.planning.targets import parse_target, target_devices

    rows, d, f, groups = _ROWS.value, _D_MODEL.value, _D_FF.value, _EXPERTS.value
    one = jax.NamedSharding(jax.sharding.Mesh(target_devices(parse_target(_TARGET.value))[:1], ("chip",)), jax.P())
    args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((groups, d, f), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=one))  # fmt: skip
    useful = 2 * rows * d * f
    figures = {"target": _TARGET.value, "rows": rows, "d_model": d, "d_ff": f, "experts": groups}
    for kind in ("ragged_dot", "megablox"):
        matmul = grouped_matmul(kind, "tpu")
        backward = jax.grad(lambda x, w, sizes, f=matmul: jnp.sum(f(x, w, sizes).astype(jnp.float32)), argnums=(0, 1))
        for phase, fn, matmuls in (("forward", matmul, 1), ("backward", backward, 2)):
            compiled = jax.jit(fn).lower(*args).compile()
            module = hlo.read(compiled.as_text())
            flops = hlo.matmul_flops(module) + kernel_cost(module)["flops"]
            figures[f"{kind}_{phase}_flops_over_useful"] = flops / (matmuls * useful)
            figures[f"{kind}_{phase}_temp_mib"] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    report("grouped_matmul", figures, append=_APPEND.value)


if __name__ == "__main__":
    app.run(main)
