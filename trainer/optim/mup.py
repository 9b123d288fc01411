"""muP (the maximal update parametrisation, Yang et al.) for Adam-type optimisers.

A model is widened by adding heads (head_dim fixed) relative to
`model.mup_base_width`, where the hyperparameters were tuned. With the width
multiplier m = d_model / mup_base_width:

- hidden weights (every matrix inside the blocks) start with std init_std / sqrt(m)
  and train at learning rate lr / m;
- embeddings, norms and the output head keep their init and learning rate;
- the logits are multiplied by 1 / m.

Each layer's activations then move by the same amount per step at any width, so
the best learning rate found on a narrow model holds on a wide one.
"""

from __future__ import annotations

import jax
import optax

from trainer.config.errors import ConfigError
from trainer.model.spec import Architecture, is_hidden

MUP_OPTIMIZERS = ("adamw", "lion")  # updates proportional to the learning rate, independent of gradient scale


def check(cfg) -> None:
    if not cfg.model.mup_base_width:
        return
    if cfg.model.tie_embeddings:
        raise ConfigError("muP treats the input embedding and the output head differently; set tie_embeddings=False.")
    if cfg.optim.name not in MUP_OPTIMIZERS:
        raise ConfigError(f"muP is implemented for {', '.join(MUP_OPTIMIZERS)}, not optim.name={cfg.optim.name!r}.")


def scale_updates(cfg, logical_names: dict) -> optax.GradientTransformation:
    """Multiply hidden weights' updates by 1/m, i.e. their learning rate (and decoupled decay)."""
    m = Architecture.from_config(cfg).width_multiplier
    factors = jax.tree.map(
        lambda n: 1.0 / m if is_hidden(n) else 1.0, logical_names, is_leaf=lambda x: isinstance(x, tuple)
    )

    def update(updates, state, params=None):
        return jax.tree.map(lambda u, f: u * f, updates, factors), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
