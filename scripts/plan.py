"""Plan a run before launching it: python scripts/plan.py --config configs/llm_1b.py [--json]

Prints parameter counts, FLOPs per token and the compiled train step's memory
per device for the configured mesh, compiling ahead of time without allocating
any parameters. --simulate_devices N plans for N devices on this host's CPU.
"""

import json
import os

from absl import flags

from trainer import cli

_CONFIG = cli.define_config_flag()
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 0, "Plan for this many simulated CPU devices.")
_NO_COMPILE = flags.DEFINE_bool("no_compile", False, "Skip the compiled memory analysis.")


def main():
    if _SIMULATE.value:
        # Must happen before JAX initialises its backends, hence the late import of the planner.
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_SIMULATE.value}"
        )
    from trainer.planning import plan

    result = plan(_CONFIG.value, compile_step=not _NO_COMPILE.value)
    if _JSON.value:
        print(json.dumps(result))
        return
    gib = 2**30
    print(f"parameters        {result['n_params']:,} ({result['n_params_non_embedding']:,} non-embedding)")
    print(f"FLOPs per token   {result['flops_per_token']:.4g}  = {result['flops_formula']}")
    print(f"FLOPs per step    {result['flops_per_step']:.4g}  ({result['tokens_per_step']:,} tokens)")
    print(f"mesh              {result['mesh']} on {result['devices']} x {result['device_kind']}")
    if "compiled_bytes_per_device" in result:
        b = result["compiled_breakdown"]
        print(
            f"memory per device {result['compiled_bytes_per_device'] / gib:.2f} GiB compiled "
            f"(arguments {b['arguments'] / gib:.2f}, temporaries {b['temporaries'] / gib:.2f}, "
            f"outputs not aliased {(b['outputs'] - b['aliased']) / gib:.2f}); "
            f"compiled in {result['compile_seconds']:.1f}s"
        )


if __name__ == "__main__":
    cli.run(main)
