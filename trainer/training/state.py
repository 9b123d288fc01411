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
from trainer.model.decoder import Decoder, ModelSpec


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: train steps taken (skipped ones included)
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32 key data, so checkpoints hold plain arrays
    stability: dict  # loss scale, learning-rate scale, clocks and running statistics (trainer/training/stability.py)


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


def state_shardings(
    model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, stability: dict
) -> TrainState:
    """Shardings for every array in the state: optimiser moments follow their parameter.

    A state array whose key path ends with a parameter's path and has its shape
    (Adam's moments, Lion's and Muon's momentum) is placed like that parameter;
    anything else (counters, Adafactor's row and column statistics) is small
    and replicated. Matching by path works for any optimiser's state layout.
    """
    params = param_shardings(model, shard)
    by_path = {
        _keys(path): (array.shape, sharding)
        for (path, array), sharding in zip(
            jax.tree_util.tree_leaves_with_path(model.abstract_params), jax.tree.leaves(params), strict=True
        )
    }
    rep = shard.replicated()

    def place(path, leaf):
        keys = _keys(path)
        for start in range(len(keys)):
            shape, sharding = by_path.get(keys[start:], (None, None))
            if shape == leaf.shape:
                return sharding
        return rep

    opt = jax.tree_util.tree_map_with_path(place, jax.eval_shape(tx.init, model.abstract_params))
    return TrainState(rep, params, opt, rep, jax.tree.map(lambda _: rep, stability))


def _keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _new_state(params, tx, key, stability) -> TrainState:
    rng = jax.random.key_data(jax.random.fold_in(key, 1))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng, stability)


def create_train_state(
    spec: ModelSpec, model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, seed: int,
    stability: dict,
) -> TrainState:  # fmt: skip
    def init(seed):
        key = jax.random.key(seed)
        return _new_state(init_params(spec, shard, jax.random.fold_in(key, 0)), tx, key, stability)

    shardings = state_shardings(model, tx, shard, stability)
    return jax.jit(init, out_shardings=shardings)(jnp.asarray(seed, jnp.uint32))


def state_from_params(
    params: dict, model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, seed: int,
    stability: dict,
) -> TrainState:  # fmt: skip
    """Step 0 of a run that starts from given (sharded) parameters, e.g. imported ones."""
    shardings = state_shardings(model, tx, shard, stability)
    new = jax.jit(lambda p, s: _new_state(p, tx, jax.random.key(s), stability), out_shardings=shardings)
    return new(params, jnp.asarray(seed, jnp.uint32))


def abstract_train_state(
    model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, stability: dict
) -> TrainState:
    """ShapeDtypeStructs carrying their shardings: restore targets and AOT-compile inputs."""
    shapes = jax.eval_shape(lambda p: _new_state(p, tx, jax.random.key(0), stability), model.abstract_params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        state_shardings(model, tx, shard, stability),
    )
