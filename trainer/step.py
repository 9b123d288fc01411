"""The jitted train and eval steps.

One train step is one optimiser update on one global batch. With
`grad_accum_steps = k` the batch is cut into k microbatches inside the jitted
step and their gradients summed in fp32 by a scan; token losses are summed and
divided once by the global token count, so k microbatches give the gradient of
the full batch, not an average of per-microbatch means.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from parallelism.rules import LogicalSharding
from trainer.loss import cross_entropy_sum
from trainer.optimizer import applied_learning_rate
from trainer.state import ModelDef, TrainState, param_shardings

BATCH_KEYS = ("tokens", "segment_ids", "positions")
BATCH_NAMES = ("batch", "seq")


def _loss_sum(model: ModelDef, params, batch):
    logits = model.apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    return cross_entropy_sum(logits, batch["tokens"], batch["segment_ids"])


def split_microbatches(batch: dict, k: int, shard: LogicalSharding) -> dict:
    """(B, T) -> (k, B/k, T), microbatch j = rows j, j+k, j+2k, ...

    Strided, not contiguous: every device's block of rows holds rows of every
    microbatch, so each microbatch stays spread over all data-parallel devices.
    """

    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return shard.constrain(x, (None, *BATCH_NAMES))

    return jax.tree.map(split, batch)


def make_train_step(
    model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, grad_accum_steps: int
) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    grad_fn = jax.value_and_grad(lambda p, b: _loss_sum(model, p, b), has_aux=True)
    grad_shardings = param_shardings(model, shard) if shard.mesh is not None else None

    def train_step(state: TrainState, batch: dict):
        if grad_accum_steps == 1:
            (loss_sum, count), grads = grad_fn(state.params, batch)
        else:

            def accumulate(carry, micro):
                grads, loss_sum, count = carry
                (micro_loss, n), g = grad_fn(state.params, micro)
                grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
                return (grads, loss_sum + micro_loss, count + n), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            if grad_shardings is not None:
                zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
            micro = split_microbatches(batch, grad_accum_steps, shard)
            (grads, loss_sum, count), _ = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), micro)

        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / count,
            "grad_norm": optax.global_norm(grads),  # before clipping
            "param_norm": optax.global_norm(params),
            "lr": applied_learning_rate(opt_state),
            "target_tokens": count,
        }
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model: ModelDef) -> Callable[[dict, dict], tuple[jax.Array, jax.Array]]:
    """(params, batch) -> (sum of token losses, token count)."""
    return lambda params, batch: _loss_sum(model, params, batch)


def jit_train_step(step_fn, state_shardings: TrainState, shard: LogicalSharding):
    """Explicit in/out shardings; the old state is donated so its buffers are reused."""
    batch = {k: shard.named(BATCH_NAMES) for k in BATCH_KEYS}
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch),
        out_shardings=(state_shardings, shard.replicated()),
        donate_argnums=0,
    )


def jit_eval_step(eval_fn, state_shardings: TrainState, shard: LogicalSharding):
    batch = {k: shard.named(BATCH_NAMES) for k in BATCH_KEYS}
    return jax.jit(eval_fn, in_shardings=(state_shardings.params, batch), out_shardings=shard.replicated())


def abstract_batch(global_batch: int, seq_len: int, sharding) -> dict:
    """The batch's shapes and placement, for compiling ahead of the first real batch."""
    return {k: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=sharding) for k in BATCH_KEYS}
