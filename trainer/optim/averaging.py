"""An exponential moving average of the weights (optim.ema_decay or optim.ema_half_life_tokens).

It is the last transform of the Optax chain, so its state is optimiser state:
checkpointed with the moments (both tiers), restored by a resume or a rollback,
reset by checkpoint.reset_optimizer, left alone by a skipped step, and each of
its arrays placed like the parameter it averages (trainer/training/state.py).

It starts at zero and keeps the weights' total mass beside the sum, so the
average it stands for (sum / mass) is the weights of every update so far,
weighted by decay^age, with no pull towards the initialisation: Adam's bias
correction, for a decay that may change from step to step. Under a half-life in
tokens the train step sets each update's decay from the tokens it trained on,
so a batch-size ramp or a new batch size keeps the half-life. Kept in float32
whatever precision.moments_dtype says: it is weights, not statistics.

Evaluation, generation, scoring and the export read it with checkpoint.read_ema
(trainer/training/resume.py), from the optimiser state's own arrays alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

FIELDS = ("ema_sum", "ema_mass")  # what a reader of the average restores


class WeightAverage(NamedTuple):
    ema_sum: dict  # sum over updates of (1 - decay) x decay^age x the weights after the update
    ema_mass: jax.Array  # 1 - the product of the decays so far: what the sum's weights add up to
    ema_decay: jax.Array  # the next update's decay, set by the train step (optimizer.with_hyperparams)


def weight_average() -> optax.GradientTransformation:
    """Passes the updates through; averages the weights they lead to."""

    def init(params):
        zero = jnp.zeros((), jnp.float32)
        return WeightAverage(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), zero, zero)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight_average needs the parameters")
        d = state.ema_decay
        new = optax.apply_updates(params, updates)
        total = jax.tree.map(lambda s, w: d * s + (1 - d) * w.astype(jnp.float32), state.ema_sum, new)
        return updates, WeightAverage(total, d * state.ema_mass + (1 - d), d)

    return optax.GradientTransformation(init, update)


def enabled(optim) -> bool:
    return bool(optim.ema_decay or optim.ema_half_life_tokens)


def step_decay(optim, tokens: int) -> float:
    """The decay of one update that trained on `tokens` token positions."""
    if optim.ema_decay:
        return float(optim.ema_decay)
    return 0.5 ** (tokens / optim.ema_half_life_tokens)


def averaged(state: WeightAverage, like: dict) -> dict:
    """The average the state stands for, in the dtypes of `like` (the parameters)."""
    mass = jnp.maximum(state.ema_mass, jnp.finfo(jnp.float32).tiny)
    return jax.tree.map(lambda s, p: (s / mass).astype(p.dtype), state.ema_sum, like)


def find(opt_state) -> WeightAverage | None:
    """The chain's WeightAverage state, or None where the optimiser keeps none."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, WeightAverage))
             if isinstance(s, WeightAverage)]  # fmt: skip
    return found[0] if found else None
