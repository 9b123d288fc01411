"""What the trainer's step costs over a bare one, and its throughput and MFU.

    python benchmarks/overhead.py --config configs/tiny.py [--steps 10] [--rounds 5] [--append]

Ours: `Setup.train_step()`, everything on (stability checks, loss scaling
hooks, learning rate set in-step, diagnosis metrics, gradient accumulation if
configured). Bare: the identical model, parameters and batch under a minimal
hand-written `jax.jit(jax.value_and_grad(loss))` + `optax.adamw` step with
global-norm clipping, nothing else. The two are timed alternately, `--steps`
steps per turn for `--rounds` rounds, in one process; `ratio` is the median
time per step of ours over bare (the target is at most 1.03).
"""

import os
import statistics
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from record import report  # noqa: E402
from timing import seconds_per_step, synthetic_batch  # noqa: E402

from trainer.run import cli  # noqa: E402

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timed turn.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternating turns of ours and bare.")
_APPEND = flags.DEFINE_bool("append", False, "Append a row to benchmarks/RESULTS.md.")


def make_bare_step(setup, lr: float):
    """The textbook step: mean next-token cross-entropy, AdamW with clipping, nothing more."""
    import jax
    import jax.numpy as jnp
    import optax

    cfg = setup.cfg
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.optim.clip_norm),
        optax.adamw(lr, b1=cfg.optim.b1, b2=cfg.optim.b2, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay),
    )

    def loss_fn(params, batch):
        logits = setup.model.apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        targets = batch["tokens"][:, 1:]
        nll = -jnp.take_along_axis(logp[:, :-1], targets[..., None], axis=-1)[..., 0]
        return nll.mean()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))


def main():
    import jax

    from trainer.model.flops import flops_per_token, peak_flops
    from trainer.training.setup import build

    cfg = _CONFIG.value
    cfg.mesh.update(dict(data=1, fsdp=1, tensor=1))
    setup = build(cfg, jax.devices()[:1])
    _, batch = synthetic_batch(cfg, setup)

    state, ours = setup.new_state(), setup.train_step()
    tx, bare = make_bare_step(setup, cfg.optim.lr)
    params = jax.tree.map(lambda a: a.copy(), state.params)
    opt_state = tx.init(params)

    def ours_step(state):
        return ours(state, batch)[0]

    def bare_step(carry):
        return bare(*carry, batch)[:2]

    carry = (params, opt_state)
    state, _ = seconds_per_step(ours_step, state, _STEPS.value)  # compile and warm up both
    carry, _ = seconds_per_step(bare_step, carry, _STEPS.value)
    ours_s, bare_s = [], []
    for _ in range(_ROUNDS.value):
        state, t = seconds_per_step(ours_step, state, _STEPS.value)
        ours_s.append(t)
        carry, t = seconds_per_step(bare_step, carry, _STEPS.value)
        bare_s.append(t)
    ours_t, bare_t = statistics.median(ours_s), statistics.median(bare_s)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(setup.spec.arch, setup.model.abstract_params, cfg.data.seq_len)
    report(
        "overhead",
        {
            "config": os.path.basename(cli.config_path()),
            "ratio": ours_t / bare_t,
            "ours_step_s": ours_t,
            "bare_step_s": bare_t,
            "tokens_per_s": tokens / ours_t,
            "mfu": fpt * tokens / ours_t / peak_flops(jax.devices()[:1]),
        },
        append=_APPEND.value,
    )


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
