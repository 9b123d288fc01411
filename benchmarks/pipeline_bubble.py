"""The pipeline bubble, measured: train-step time against microbatch count, beside (p-1)/(m+p-1).

    python benchmarks/pipeline_bubble.py --config configs/tiny.py [--stages 4]
        [--microbatches 4,8,16,32] [--steps 5] [--simulate_devices 4] [--append]

The global batch is fixed, so every run does the same useful work; the
reference is the same model and batch on the same devices without a pipeline
(data parallel over them). The measured bubble is 1 - t(reference) /
t(pipeline). On simulated CPU devices every stage's ticks run on the host's
cores, idle ticks included (they compute on padding), so the time grows by
(m+p-1)/m as a real pipeline's does through idling; the smaller microbatches'
different efficiency per row and the stage-to-stage copies add to it.
"""

import os
import statistics
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import synthetic_batch  # noqa: E402

from parallelism import accelerators  # noqa: E402
from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages.")
_MICRO = flags.DEFINE_list("microbatches", ["4", "8", "16", "32"], "Pipeline microbatch counts to time.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per setting (after one warm-up step); the median is used.")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 4, "Simulated CPU devices (0 = the real ones).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def step_seconds(cfg, n_devices: int) -> float:
    import jax

    from trainer.training.setup import build

    setup = build(cfg, jax.devices()[:n_devices])
    state, step = setup.new_state(), setup.train_step()
    _, batch = synthetic_batch(cfg, setup)
    times = []
    for i in range(_STEPS.value + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        if i:  # the first step compiles
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    from parallelism.pipeline import bubble_fraction

    base, stages = _CONFIG.value, _STAGES.value
    base.mesh.update(dict(stage=1, data=stages, fsdp=1, tensor=1))
    one = step_seconds(base, stages)
    figures = {"config": os.path.basename(cli.config_path())}
    figures.update({"stages": stages, "global_batch": base.train.global_batch_size, "data_parallel_s": one})
    for m in (int(x) for x in _MICRO.value):
        cfg = base.copy_and_resolve_references()
        cfg.mesh.update(dict(stage=stages, data=1))
        cfg.train.pipeline_microbatches = m
        seconds = step_seconds(cfg, stages)
        figures[f"m{m}_s"] = seconds
        figures[f"m{m}_bubble"] = 1 - one / seconds
        figures[f"m{m}_formula"] = bubble_fraction(stages, m)
    report("pipeline_bubble", figures, append=_APPEND.value)


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
