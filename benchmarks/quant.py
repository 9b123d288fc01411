"""Quantised training side by side: the same run in the compute dtype, int8 and fp8 (model.quant.matmul).

    python benchmarks/quant.py --config configs/tiny.py [overrides] [--append]
    python benchmarks/quant.py --config configs/llm_1b.py --targets=v5e-8,v6e-8 [--append]

Each kind trains the config's run from scratch in a workdir of its own (same seed, steps and data) and
reports its validation loss at the end (the loop's held-out batches; the config must evaluate, eval_every
> 0) and its loss over the compute dtype's; the step time is the median of `--steps` steps of a synthetic
batch after one to compile (benchmarks/timing.py). On a CPU the quantised dots run as written, int8 with
int32 sums, fp8 widened first: the losses are what quantisation does to training, the times are not what a
TPU or GPU would give.

With --targets, nothing trains: the step is compiled for each target (scripts/plan.py's compile: XLA:TPU
through libtpu, XLA:GPU through JAX's CUDA plugin, no chip needed) with int8 matmuls on a TPU, fp8 on a GPU,
and without, and the compiler's figures for both are reported (`quant_compiled`): FLOPs, HBM bytes and the
roofline read from the compiled HLO (the low-precision dots at the chip's rate for them), the share of the
FLOPs in low-precision dots, and the memory per device. They are the compiler's model of the step; only
hardware measures it.
"""

import os
import sys
import tempfile

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import step_seconds_and_memory  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per kind (after one to compile).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")
_TARGETS = flags.DEFINE_list("targets", [], "Compile for these targets (e.g. v5e-8,v6e-8) instead of training.")

SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def compiled(base) -> None:
    from trainer.planning.plan import plan
    from trainer.planning.targets import parse_target

    figures = {"config": os.path.basename(cli.config_path())}
    for target in _TARGETS.value:
        cfg = base.copy_and_resolve_references()
        kind = cfg.model.quant.matmul = "fp8" if parse_target(target).is_gpu else "int8"  # what each chip runs
        result = plan(cfg, target=target)
        for name, cost in ((SHORT[cfg.precision.compute_dtype], result["cost_unquantised"]), (kind, result["cost"])):
            figures[f"{target}_{name}_flops"] = cost["flops"]
            figures[f"{target}_{name}_hbm_gb"] = cost["bytes_accessed"] / 1e9
            figures[f"{target}_{name}_roofline_s"] = cost["roofline_seconds"]
        low = sum(v["flops"] for k, v in result["cost"]["matmuls"].items() if k == "s8" or k.startswith("f8"))
        figures[f"{target}_{kind}_low_flops_share"] = low / result["cost"]["flops"]
        figures[f"{target}_{kind}_gib"] = result["compiled_bytes_per_device"] / 2**30
    report("quant_compiled", figures, append=_APPEND.value)


def main():
    import jax

    from parallelism import accelerators
    from trainer.run.loop import train

    if _TARGETS.value:  # as scripts/plan.py: the targets' devices are descriptions, no backend but the CPU's runs
        jax.config.update("jax_platforms", "cpu")
    accelerators.start()
    base = _CONFIG.value
    if _TARGETS.value:
        return compiled(base)
    if not base.train.eval_every:
        raise SystemExit("the config must evaluate (train.eval_every > 0): the validation loss is what is compared")
    figures = {"config": os.path.basename(cli.config_path()), "steps": base.train.steps}
    losses = {}
    for kind in ("", "int8", "fp8"):
        cfg = base.copy_and_resolve_references()
        cfg.model.quant.matmul = kind
        name = kind or SHORT[cfg.precision.compute_dtype]
        with tempfile.TemporaryDirectory() as workdir:
            result = train(cfg, workdir)
        if result.get("preempted"):  # a SIGTERM ends the run early: its loss is not the comparison's
            raise SystemExit(f"the {name} run was stopped at step {result['step']}; nothing recorded")
        losses[name] = result["eval_loss"]
        figures[f"{name}_eval_loss"] = losses[name]
        figures[f"{name}_step_s"] = step_seconds_and_memory(cfg, _STEPS.value)[0]
    first = next(iter(losses))
    for name in list(losses)[1:]:
        figures[f"{name}_loss_over_{first}"] = losses[name] / losses[first]
    report("quant", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
