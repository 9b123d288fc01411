"""The Optax chain: global-norm clipping, then AdamW on a scheduled learning rate.

Weight decay is decoupled (applied to the parameters, scaled by the learning
rate, not mixed into the Adam moments) and skips norm scales and biases: decaying
a norm's gain towards zero fights the normalisation instead of regularising.
"""

from __future__ import annotations

import jax
import optax

from trainer.schedules import make_schedule

NO_DECAY_NAMES = ("scale", "bias")


def decay_mask(params):
    """True where weight decay applies: every parameter but norm scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY_NAMES, params
    )


def make_optimizer(cfg) -> optax.GradientTransformation:
    o = cfg.optim

    # The mask is a closure, not an argument: inject_hyperparams would take a
    # callable argument for a schedule and silently disable the decay.
    def adamw(learning_rate, weight_decay):
        return optax.adamw(learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=weight_decay, mask=decay_mask)

    # inject_hyperparams keeps the learning rate each update used in the
    # optimiser state, so the logged value is the applied one, not a recomputation.
    tx = optax.inject_hyperparams(adamw)(learning_rate=make_schedule(o, cfg.train.steps), weight_decay=o.weight_decay)
    clip = optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity()
    return optax.chain(clip, tx)


def applied_learning_rate(opt_state) -> jax.Array:
    """The rate the last update used: chain state = (clip, injected AdamW)."""
    return opt_state[1].hyperparams["learning_rate"]
