"""The training state and where each of its arrays lives.

Parameters are plain nested dicts of arrays (NNX's pure state); the model's
structure lives in a graphdef that the step merges them into. The state is
created inside `jax.jit` with `out_shardings`, so every array is born in its
place on the mesh and no host ever holds a full copy.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.model import Decoder, ModelSpec


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimiser updates applied so far
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32 key data, so checkpoints hold plain arrays


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """What is known of a model before any parameter exists."""

    graphdef: nnx.GraphDef
    abstract_params: dict  # ShapeDtypeStructs
    logical_names: dict  # tuple of logical axis names per parameter

    @classmethod
    def create(cls, spec: ModelSpec, shard: LogicalSharding) -> ModelDef:
        abstract = nnx.eval_shape(lambda: Decoder(spec, shard, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        names = jax.tree.map(
            lambda v: v.get_metadata()["out_sharding"], state, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
        return cls(graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(names))

    def apply(self, params: dict, *args, method: str = "__call__", **kwargs):
        return getattr(nnx.merge(self.graphdef, params), method)(*args, **kwargs)


def init_params(spec: ModelSpec, shard: LogicalSharding, seed) -> dict:
    """Fresh parameters as a pure dict; call it under jit to place them sharded."""
    return nnx.to_pure_dict(nnx.state(Decoder(spec, shard, rngs=nnx.Rngs(seed))))


def param_shardings(model: ModelDef, shard: LogicalSharding) -> dict:
    return jax.tree.map(shard.named, model.logical_names, is_leaf=lambda x: isinstance(x, tuple))


def abstract_params(model: ModelDef, shard: LogicalSharding) -> dict:
    """Parameter shapes with their shardings: the target for restoring parameters alone."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model.abstract_params,
        param_shardings(model, shard),
    )


def state_shardings(model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding) -> TrainState:
    """Shardings for every array in the state: optimiser moments follow their parameter."""
    params = param_shardings(model, shard)
    opt_abstract = jax.eval_shape(tx.init, model.abstract_params)
    opt = optax.tree_map_params(
        tx, lambda _, s: s, opt_abstract, params, transform_non_params=lambda _: shard.replicated()
    )
    rep = shard.replicated()
    return TrainState(step=rep, params=params, opt_state=opt, rng=rep)


def create_train_state(
    spec: ModelSpec, model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, seed: int
) -> TrainState:
    def init(seed):
        key = jax.random.key(seed)
        params = init_params(spec, shard, jax.random.fold_in(key, 0))
        rng = jax.random.key_data(jax.random.fold_in(key, 1))
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng)

    shardings = state_shardings(model, tx, shard)
    return jax.jit(init, out_shardings=shardings)(jnp.asarray(seed, jnp.uint32))


def abstract_train_state(model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding) -> TrainState:
    """ShapeDtypeStructs carrying their shardings: restore targets and AOT-compile inputs."""
    shapes = jax.eval_shape(
        lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), jax.random.key_data(jax.random.key(0))),
        model.abstract_params,
    )
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        state_shardings(model, tx, shard),
    )
