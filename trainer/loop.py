"""The training loop: build, restore or initialise, step, log, evaluate, checkpoint.

The loop never waits on the devices between log points: a step's metrics stay
on device until a log step fetches them, so host work (reading the next batch)
overlaps with device compute. Step time is wall time over the interval between
two log points, evaluation and checkpoint time excluded.

SIGTERM (preemption) finishes the step in flight, saves a checkpoint at it and
returns; the same command later resumes from there.
"""

from __future__ import annotations

import time

import jax

from parallelism.distributed import fetch
from trainer import workdir as wd
from trainer.checkpoint import Checkpointer
from trainer.data import pipeline
from trainer.evaluate import Evaluator
from trainer.flops import count_params, flops_per_token, peak_flops
from trainer.metrics import MetricsWriter
from trainer.planning import compiled_memory
from trainer.preemption import watch_for_sigterm
from trainer.setup import Setup, build
from trainer.state import abstract_train_state, create_train_state
from trainer.step import abstract_batch, jit_train_step, make_train_step


def prepare_run(cfg, workdir: str) -> Setup:
    """Every check that can fail, before anything is compiled; the workdir is created last."""
    setup = build(cfg)
    pipeline.check_vocab(cfg)
    if cfg.data.source != "synthetic":
        if jax.process_index() == 0:
            pipeline.prepare(cfg.data)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("dataset prepared")
        pipeline.open_split(cfg.data, cfg.data.train_split)
        if cfg.train.eval_every:
            pipeline.open_split(cfg.data, cfg.data.eval_split)
    wd.check_matches(workdir, cfg, wd.RESUME_KEYS)
    wd.check_writable(workdir)
    return setup


def train(cfg, workdir: str) -> dict:
    """Train, or resume from the newest readable checkpoint in `workdir`; returns the last logged values."""
    setup = prepare_run(cfg, workdir)
    primary = jax.process_index() == 0
    say = print if primary else (lambda *a, **k: None)
    if primary:
        wd.write_config(workdir, cfg)
    t, B, T = cfg.train, cfg.train.global_batch_size, cfg.data.seq_len

    rows = pipeline.process_rows(setup.batch_sharding, B, T)
    ckpt = Checkpointer(
        wd.checkpoint_dir(workdir),
        keep=cfg.checkpoint.keep,
        keep_every=cfg.checkpoint.keep_every,
        async_save=cfg.checkpoint["async"],
    )
    latest = ckpt.latest_step()
    if latest is not None and latest >= t.steps:
        say(f"already trained to step {latest} of {t.steps}; raise train.steps to go on")
        ckpt.close()
        return {"step": latest}

    abstract = abstract_train_state(setup.model, setup.tx, setup.shard)

    def restore(step):
        data = iter(pipeline.batches(cfg, cfg.data.train_split, rows, shuffle=True))
        return ckpt.restore(step, abstract, data), data

    found = ckpt.restore_newest_intact(restore, say)
    if found is None:
        state = create_train_state(setup.spec, setup.model, setup.tx, setup.shard, t.seed)
        data = iter(pipeline.batches(cfg, cfg.data.train_split, rows, shuffle=True))
        start = 0
    else:
        start, (state, data) = found
        say(f"resumed from the checkpoint at step {start}")

    counts = count_params(setup.model.abstract_params)
    fpt = flops_per_token(setup.spec, setup.model.abstract_params, T)
    peak = peak_flops(setup.mesh.devices.flatten().tolist())
    say(
        f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{fpt / 1e6:.1f} MFLOPs/token; mesh {dict(setup.mesh.shape)}"
    )

    compile_start = time.perf_counter()
    step_fn = jit_train_step(
        make_train_step(setup.model, setup.tx, setup.shard, t.grad_accum_steps), setup.state_shardings, setup.shard
    )
    step_fn = step_fn.lower(state, abstract_batch(B, T, setup.batch_sharding)).compile()
    say(
        f"compiled the train step in {time.perf_counter() - compile_start:.1f}s, "
        f"{compiled_memory(step_fn)['total'] / 2**30:.2f} GiB per device"
    )

    evaluator = Evaluator(setup, rows) if t.eval_every else None
    unigram = evaluator.unigram_loss() if evaluator else None
    writer = MetricsWriter(workdir, resume_step=start, enabled=primary)
    last: dict = {}
    step, mark_step, mark_time = start, start, time.perf_counter()
    try:
        with watch_for_sigterm() as stop:
            while step < t.steps and not stop.requested:
                batch = pipeline.to_global(next(data), setup.batch_sharding, B)
                state, metrics = step_fn(state, batch)
                step += 1
                if step % t.log_every == 0 or step == t.steps:
                    values = {k: float(v) for k, v in fetch(metrics).items()}
                    step_time = (time.perf_counter() - mark_time) / (step - mark_step)
                    tokens_per_sec = B * T / step_time
                    mfu = fpt * tokens_per_sec / peak if peak else None
                    last = {**values, "tokens_per_sec": tokens_per_sec, "mfu": mfu, "step_time": step_time}
                    writer.write(step, last, console=_console_line(step, t.steps, last))
                    mark_step, mark_time = step, time.perf_counter()
                evaluate = evaluator is not None and (step % t.eval_every == 0 or step == t.steps)
                save = step % cfg.checkpoint.every_steps == 0 or step == t.steps or stop.requested
                if not (evaluate or save):
                    continue
                # Let queued training steps finish first, so that the pause excluded
                # from step_time is evaluation and saving alone.
                jax.block_until_ready(state)
                paused = time.perf_counter()
                if evaluate:
                    result = {**evaluator(state.params), "unigram_loss": unigram}
                    last.update(result)
                    writer.write(
                        step,
                        result,
                        console=f"step {step:>6}  eval_loss {result['eval_loss']:.4f}  (unigram {unigram:.4f})",
                    )
                if save:
                    ckpt.save(step, state, data)
                mark_time += time.perf_counter() - paused
            if stop.requested:
                say(f"stopping on signal {stop.signal}: checkpoint saved at step {step}; rerun to resume")
                last["preempted"] = True
    finally:
        ckpt.wait()
        ckpt.close()
        writer.close()
    return {"step": step, **last}


def _console_line(step: int, total: int, m: dict) -> str:
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    return (
        f"step {step:>6}/{total}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
        f"tok/s {m['tokens_per_sec']:,.0f}  mfu {mfu}  step {m['step_time']:.3f}s"
    )
