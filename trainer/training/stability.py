"""Keeping a run alive: bad steps are skipped on the device, persistent trouble is rolled back.

On the device, each step is judged before it is applied: non-finite loss or
gradients, or a gradient norm above `spike_factor` x its running mean, leave
parameters and optimiser state untouched. Such a step is bad, except an fp16
overflow while the loss scale is still falling (trainer/training/precision.py): that
one is skipped but not held against the run. Running statistics (exponential
means, half-life ~70 steps) follow applied steps only.

The device also keeps the verdicts of the last `bad_window` steps, so that the
loop, reading them at its log points (no extra host syncs), can see
`max_bad_steps` bad steps in the window, or a loss above `diverge_factor` x its
running mean for `diverge_steps` steps in a row (not under GRPO, whose loss sits near 0 of either sign), and
roll back to the newest
checkpoint saved while healthy, skip the data read since, and lower the
learning rate (trainer/run/rollback.py). The drills in `config.debug` feed it
corrupted batches or a learning rate far too high, counted in global batches of the data stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainer.config import stream_rows

EMA_DECAY = 0.99


def initial_state(cfg) -> dict:
    return {
        "lr_scale": jnp.float32(1.0),  # lowered at each rollback
        "grad_norm_mean": jnp.float32(0.0),
        "loss_mean": jnp.float32(0.0),
        "stat_steps": jnp.int32(0),
        "skipped": jnp.int32(0),  # steps skipped so far (bad ones and fp16 overflows)
        "diverged_run": jnp.int32(0),  # steps in a row with the loss far above its mean
        "recent_bad": jnp.zeros((cfg.stability.bad_window,), jnp.int32),  # verdicts of the last steps, a ring
        "rollbacks": jnp.int32(0),
        "rerun_transient": jnp.int32(0),  # bad steps that gave another result when computed again (rerun_bad_steps)
        "rerun_persistent": jnp.int32(0),  # ... and the same result
    }


def judge(cfg, stats: dict, loss: jax.Array, grad_norm: jax.Array):
    """(apply?, finite?, spike?) for one step."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ready = stats["stat_steps"] >= cfg.stability.stats_warmup
    spike = (
        ready & (cfg.stability.spike_factor > 0) & (grad_norm > cfg.stability.spike_factor * stats["grad_norm_mean"])
    )
    return finite & ~spike, finite, spike


def update_statistics(cfg, stats: dict, step: jax.Array, ok, bad, loss: jax.Array, grad_norm: jax.Array) -> dict:
    """Running means over applied steps; the divergence counter; skipped steps and the recent bad ones."""
    first = stats["stat_steps"] == 0

    def ema(mean, value):
        return jnp.where(ok, jnp.where(first, value, EMA_DECAY * mean + (1 - EMA_DECAY) * value), mean)

    ready = stats["stat_steps"] >= cfg.stability.stats_warmup
    diverged = ok & ready & (loss > cfg.stability.diverge_factor * stats["loss_mean"])
    if cfg.data.format == "prompts":  # GRPO's loss sits near 0, of either sign: no measure of a run's health
        diverged = jnp.zeros_like(diverged)
    return {
        **stats,
        "grad_norm_mean": ema(stats["grad_norm_mean"], grad_norm),
        "loss_mean": ema(stats["loss_mean"], loss),
        "stat_steps": stats["stat_steps"] + ok.astype(jnp.int32),
        "skipped": stats["skipped"] + (~ok).astype(jnp.int32),
        "diverged_run": jnp.where(diverged, stats["diverged_run"] + 1, jnp.where(ok, 0, stats["diverged_run"])),
        "recent_bad": stats["recent_bad"].at[step % stats["recent_bad"].shape[0]].set(bad.astype(jnp.int32)),
    }


def trouble(cfg, bad_in_window: int, diverged_run: int) -> str | None:
    """Why the run should roll back, or None: judged on the host from the device's counters."""
    s = cfg.stability
    if s.max_bad_steps and bad_in_window >= s.max_bad_steps:
        return f"{bad_in_window} bad steps in the last {s.bad_window}"
    if s.diverge_steps and diverged_run >= s.diverge_steps:
        return f"loss above {s.diverge_factor:g}x its running mean for {diverged_run} steps"
    return None


def healthy(stats: dict) -> bool:
    """Whether a (restored) stability state was saved by a run in good shape: no bad step in its
    recent window and no divergence under way. Only such checkpoints are rolled back to."""
    return int(np.sum(stats["recent_bad"])) == 0 and int(stats["diverged_run"]) == 0


def adopt(saved: dict, cfg, step: int) -> dict:
    """A restored stability state (host arrays, as saved) in the shape this config's runs keep.

    The ring of recent verdicts is re-laid for another `bad_window` (the last
    steps' verdicts kept), and entries a newer trainer added start fresh.
    """
    out = {k: np.array(v) for k, v in initial_state(cfg).items()}
    out.update({k: np.asarray(v) for k, v in saved.items() if k in out and k != "recent_bad"})
    ring, window = np.asarray(saved["recent_bad"]), cfg.stability.bad_window
    for s in range(max(0, step - min(window, len(ring))), step):
        out["recent_bad"][s % window] = ring[s % len(ring)]
    return out


def drill_multipliers(cfg, data_read: dict, rows: int) -> tuple[jax.Array, jax.Array]:
    """(loss multiplier, learning-rate multiplier) for a step that reads `rows` sequences from `data_read` (a
    count, trainer/training/clock.py) on, from the drills in `config.debug`, counted in global batches of the
    data stream; computed on the device."""
    d = cfg.debug
    first, last = _batches_read(cfg, data_read, rows)
    poisoned = jnp.zeros((), bool)
    if d.poison_batches:
        poisoned = _among(d.poison_batches, first, last)
    lr = jnp.float32(1.0)
    if d.lr_spike:
        low, high, factor = d.lr_spike
        lr = jnp.where((first <= high) & (last >= low), jnp.float32(factor), lr)
    return jnp.where(poisoned, jnp.float32(jnp.nan), jnp.float32(1.0)), lr


def _batches_read(cfg, data_read: dict, rows: int) -> tuple[jax.Array, jax.Array]:
    """The first and last global batch of the data stream that a step of `rows` sequences reads."""
    first = data_read["batches"]
    return first, first + (data_read["rows"] + rows - 1) // stream_rows(cfg)


def _among(batches, first, last) -> jax.Array:
    """Whether a drill's data batches include one of first..last."""
    batches = jnp.asarray(batches, jnp.int32)
    return jnp.any((batches >= first) & (batches <= last))


def flipped(cfg, grads: dict, data_read: dict, rows: int) -> dict:
    """The debug.flip_batches drill: in those data batches the largest element of one gradient has its exponent's
    highest bit flipped (far past any spike factor), as a fault in one device's arithmetic would, once: computed
    again (rerun_bad_steps) the step gives another result."""
    if not cfg.debug.flip_batches:
        return grads
    hit = _among(cfg.debug.flip_batches, *_batches_read(cfg, data_read, rows))
    leaves, tree = jax.tree.flatten(grads)
    flat = leaves[0].ravel()
    i = jnp.argmax(jnp.abs(flat))
    bits = jax.lax.bitcast_convert_type(flat[i], jnp.uint32) ^ jnp.uint32(1 << 30)
    flat = flat.at[i].set(jnp.where(hit, jax.lax.bitcast_convert_type(bits, jnp.float32), flat[i]))
    return jax.tree.unflatten(tree, [flat.reshape(leaves[0].shape), *leaves[1:]])


def rerun(stats: dict, bad, loss, grad_norm, again) -> dict:
    """stability.rerun_bad_steps: a bad step's loss and gradient norm computed `again()` (only where it was bad).
    The same result (within 1e-6: the same arithmetic, scheduled inside a conditional; or non-finite both times)
    is a persistent fault, the batch's or a chip's that is always wrong; another is a transient one. Counted."""

    def same(a, b):
        finite = jnp.isfinite(a) & jnp.isfinite(b)
        return (finite & (jnp.abs(a - b) <= 1e-6 * jnp.abs(a))) | (~jnp.isfinite(a) & ~jnp.isfinite(b))

    def compare(_):
        loss_again, norm_again = again()
        return same(loss, loss_again) & same(grad_norm, norm_again)

    alike = jax.lax.cond(bad, compare, lambda _: jnp.bool_(True), None)
    return {**stats, "rerun_persistent": stats["rerun_persistent"] + (bad & alike).astype(jnp.int32),
            "rerun_transient": stats["rerun_transient"] + (bad & ~alike).astype(jnp.int32)}  # fmt: skip


def skipped_event(cfg, step: int, skipped: int, total: int, values: dict, seen: dict) -> tuple[dict, str, dict]:
    """(the event, its console line, the re-run totals now seen) for `skipped` steps skipped since the last log
    line (`values`: this one's metrics; `seen`: the re-run totals at the last)."""
    event, said = {"event": "skipped", "steps": skipped, "total": total}, ""
    if cfg.stability.rerun_bad_steps:  # each bad step's verdict, computed again on the device
        now = {k: int(values[f"rerun_{k}"]) for k in seen}
        event["rerun"] = {k: now[k] - seen[k] for k in seen}
        seen = now
        counted = ", ".join(f"{n} {k}" for k, n in event["rerun"].items())
        said = f"; computed again: {counted} (another result: a hardware fault; the same: the batch, or a bad chip)"
    line = (f"step {step:>6}  skipped {skipped} step(s) since the last log line (non-finite, spiking or "
            f"fp16-overflowing gradients; {total} in all): parameters unchanged by them{said}")  # fmt: skip
    return event, line, seen
