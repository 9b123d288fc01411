"""The Optax chain: global-norm clipping, then the chosen optimiser at an injected learning rate.

Every optimiser gets the same clipping, the same decoupled weight decay (applied
to the parameters, scaled by the learning rate) and the same decay mask: the
matrices, as their logical axes say (model/spec.py).

- adamw: the default.
- lion: sign of an interpolated momentum; wants a 3-10x smaller learning rate.
- adafactor: factored second moments (row and column statistics), little memory.
- sgd: heavy-ball momentum (`optim.momentum`).
- muon: Newton-Schulz-orthogonalised momentum for the layers' weight matrices
  (the stacked layer axis is a batch axis), AdamW for embeddings, norms and the
  head; its updates are scaled to AdamW's RMS so one learning rate serves both.

The learning rate and weight decay are hyperparameters in the optimiser state,
set by the train step before each update (schedule x rollback scale), so the
logged rate is the one the update used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from trainer.model.spec import is_hidden, is_matrix
from trainer.optim import averaging


def _by_axes(rule, logical_names: dict):
    return jax.tree.map(rule, logical_names, is_leaf=lambda x: isinstance(x, tuple))


def decay_mask(logical_names: dict):
    """True where weight decay applies: the matrices, read from the logical axes (spec.is_matrix)."""
    return _by_axes(is_matrix, logical_names)


def muon_dimensions(logical_names: dict):
    """Which axes of each hidden matrix are its input and output; None (AdamW) for everything else."""

    def dims(names):
        if not is_hidden(names):
            return None  # embeddings, head, norms
        first = 2 if names[1] == "expert" else 1  # an MoE layer's experts: a batch axis, like the layers'
        if names[first] == "embed":  # (layers, [expert,] embed, out...): wq, wk, wv, w_gate, w_up, router
            return MuonDimensionNumbers(reduction_axis=(first,), output_axis=tuple(range(first + 1, len(names))))
        # (layers, [expert,] in..., embed): wo, w_down
        return MuonDimensionNumbers(reduction_axis=tuple(range(first, len(names) - 1)), output_axis=(len(names) - 1,))

    return _by_axes(dims, logical_names)


def moments_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Keep `inner`'s floating-point state in `dtype` (bfloat16 halves Adam's memory); compute in fp32."""

    def cast(tree, to):
        return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def make_optimizer(cfg, logical_names: dict) -> optax.GradientTransformation:
    o = cfg.optim
    mask = decay_mask(logical_names)

    # The mask is a closure, not an argument: inject_hyperparams would take a callable
    # argument for a schedule and silently disable the decay.
    def build(learning_rate, weight_decay):
        if o.name == "adamw":
            inner = optax.adamw(learning_rate, o.b1, o.b2, o.eps, weight_decay=weight_decay, mask=mask)
        elif o.name == "lion":
            inner = optax.lion(learning_rate, o.b1, o.b2, weight_decay=weight_decay, mask=mask)
        elif o.name == "adafactor":
            # optax.adafactor's defaults (factored second moments, decay 0.8, update RMS clipped
            # at 1), assembled here so that weight decay is scaled by the learning rate like every
            # other optimiser's: optax.adafactor adds weight_decay_rate x param *after* the rate,
            # which at 0.1 shrank the weights 10% per step. Not multiplied by the parameters'
            # scale (T5's relative step): with small initial weights that shrinks updates ~50x.
            inner = optax.chain(
                optax.scale_by_factored_rms(),
                optax.clip_by_block_rms(1.0),
                optax.add_decayed_weights(weight_decay, mask),
                optax.scale_by_learning_rate(learning_rate),
            )
        elif o.name == "sgd":
            inner = optax.chain(
                optax.trace(decay=o.momentum),
                optax.add_decayed_weights(weight_decay, mask),
                optax.scale_by_learning_rate(learning_rate),
            )
        else:  # muon
            # Decay applied here, after the rate, as -lr x wd x w: optax's muon decays its AdamW
            # side without the mask (norm scales and all).
            inner = optax.chain(
                optax.contrib.muon(
                    learning_rate, beta=o.b1, adam_b1=o.b1, adam_b2=o.b2,
                    muon_weight_dimension_numbers=muon_dimensions(logical_names), consistent_rms=0.2,
                ),
                optax.add_decayed_weights(-learning_rate * weight_decay, mask),
            )  # fmt: skip
        if cfg.precision.moments_dtype != "float32":
            inner = moments_in(jnp.dtype(cfg.precision.moments_dtype), inner)
        return inner

    tx = optax.inject_hyperparams(build)(learning_rate=0.0, weight_decay=o.weight_decay)
    clip = optax.clip_by_global_norm(o.clip_norm) if o.clip_norm > 0 else optax.identity()
    chain = [clip, tx]
    if cfg.model.mup_base_width:
        from trainer.optim.mup import scale_updates

        chain.append(scale_updates(cfg, logical_names))
    if averaging.enabled(o):  # last: it averages the weights that the updates above lead to
        chain.append(averaging.weight_average())
    return optax.chain(*chain)


def applied_learning_rate(opt_state) -> jax.Array:
    """The rate the last update used, found by its name in the injected hyperparameters."""
    return optax.tree_utils.tree_get(opt_state, "learning_rate")


def with_hyperparams(opt_state, **values):
    """The optimiser state with the hyperparameters (learning_rate, weight_decay; ema_decay where the weights
    are averaged) the next update uses.

    Set before every update, so that the schedule, a rollback's scale and a
    resumed run's config decide them, never what a checkpoint happened to hold.
    """
    return optax.tree_utils.tree_set(opt_state, **values)
