"""The input pipeline's speed against what training consumes, and the host's time per step.

    python benchmarks/input_pipeline.py --config configs/tiny.py [--batches 50] [--steps 10] [--append]
    python benchmarks/input_pipeline.py --config configs/llm_1b.py --per_core [--config.data.tokenizer=hf ...]

`--per_core`: only the data paths, each in one thread (one core): tokenising on
the fly (`tokenize_tokens_per_s_per_core`) and reading the tokenised cache
(`cache_tokens_per_s_per_core`, the cache made first if missing), against what
llm_1b consumes on an 8 x H100 host at 50% MFU (`needed_tokens_per_s`: 8 x
989 TFLOP/s x 0.5 / llm_1b's FLOPs per token), and how many cores of
tokenising (`tokenize_workers_needed`) or of cache reading
(`cache_workers_needed`) that host would give its input pipeline.

`pipeline_tokens_per_s`: global batches read, packed and stacked on the host
alone (the prepared TFDS corpus, shuffled, as training reads it).
`train_tokens_per_s`: a bare loop's rate (next batch, transfer, step, wait), with
`host_s_per_step` the part of each step spent on the host (next batch, device
transfer) and `step_s` the whole step. `headroom` = pipeline rate over
training rate: above 1 the data keeps up. `loop_step_s`: the real training
loop's median step time logging every step (its worst case: every step's
metrics fetched), and `loop_overhead_s` = loop_step_s - step_s, what the loop's
own host work adds to a step.
"""

import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import pipeline_rate  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_BATCHES = flags.DEFINE_integer("batches", 50, "Batches read for the pipeline-only rate.")
_STEPS = flags.DEFINE_integer("steps", 10, "Training steps timed (after one to compile).")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")
_PER_CORE = flags.DEFINE_bool("per_core", False, "Measure the data paths alone, per core, against llm_1b on 8 H100s.")


def per_core(cfg, batches: int) -> dict:
    import math

    import jax

    from parallelism.chips import CHIPS
    from trainer.data import corpora
    from trainer.model.flops import flops_per_token
    from trainer.training.setup import build

    corpora.prepare(cfg.data)
    setup = build(cfg, jax.devices()[:1])
    per_token = flops_per_token(setup.spec.arch, setup.model.abstract_params, cfg.data.seq_len)
    needed = 8 * CHIPS["h100"].peak_flops * 0.5 / per_token
    tokenize = pipeline_rate(cfg, batches)
    cached = cfg.copy_and_resolve_references()
    cached.data.tokenized = True
    corpora.prepare(cached.data)
    cache = pipeline_rate(cached, batches)
    return {
        "config": os.path.basename(cli.config_path()),
        "tokenizer": cfg.data.tokenizer,
        "tokenize_tokens_per_s_per_core": tokenize,
        "cache_tokens_per_s_per_core": cache,
        "needed_tokens_per_s": needed,
        "tokenize_workers_needed": math.ceil(needed / tokenize),
        "cache_workers_needed": math.ceil(needed / cache),
    }


def loop_step_seconds(cfg, steps: int) -> float:
    """The median `step_time` the training loop logs, every step logged, no evaluation or saves."""
    import statistics
    import tempfile

    from trainer.run.loop import train
    from trainer.storage.metrics import read_records

    cfg = cfg.copy_and_resolve_references()
    cfg.train.update(steps=steps + 1, log_every=1, eval_every=0)
    cfg.optim.update(warmup_steps=1, decay_steps=0)
    cfg.checkpoint.every_steps = 10 * steps
    with tempfile.TemporaryDirectory() as workdir:
        train(cfg, workdir)
        times = [r["step_time"] for r in read_records(workdir) if "step_time" in r]
    return statistics.median(times[1:])  # the first includes the first step's dispatch and warm-up


def main():
    import jax

    from trainer.data import corpora, streams
    from trainer.training.setup import build

    cfg = _CONFIG.value
    if _PER_CORE.value:
        report("input_pipeline_per_core", per_core(cfg, _BATCHES.value), append=_APPEND.value)
        return
    corpora.prepare(cfg.data)
    setup = build(cfg)
    batch_size = cfg.train.global_batch_size
    tokens_per_step = batch_size * cfg.data.seq_len

    data = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(batch_size), shuffle=True))
    next(data)
    start = time.perf_counter()
    for _ in range(_BATCHES.value):
        next(data)
    pipeline_tps = _BATCHES.value * tokens_per_step / (time.perf_counter() - start)

    state, step = setup.new_state(), setup.train_step()
    host, total = 0.0, 0.0
    for i in range(_STEPS.value + 1):
        t0 = time.perf_counter()
        batch = streams.to_global(next(data), setup.batch_sharding, batch_size)
        t1 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        if i:  # the first step compiles
            host, total = host + t1 - t0, total + time.perf_counter() - t0
    train_tps = _STEPS.value * tokens_per_step / total
    loop_step = loop_step_seconds(cfg, _STEPS.value)
    report(
        "input_pipeline",
        {
            "config": os.path.basename(cli.config_path()),
            "pipeline_tokens_per_s": pipeline_tps,
            "train_tokens_per_s": train_tps,
            "headroom": pipeline_tps / train_tps,
            "host_s_per_step": host / _STEPS.value,
            "step_s": total / _STEPS.value,
            "loop_step_s": loop_step,
            "loop_overhead_s": loop_step - total / _STEPS.value,
        },
        append=_APPEND.value,
    )


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
