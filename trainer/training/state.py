"""The training state and where each of its arrays lives.

Parameters are plain nested dicts of arrays (NNX's pure state); the model's
structure lives in a graphdef that the step merges them into. The state is
created inside `jax.jit` with `out_shardings`, so every array is born in its
place on the mesh and no host ever holds a full copy. Besides parameters and
optimiser state it holds three small dicts of replicated scalars: the clock
(where the schedule and the data stream stand), the loss scale
(trainer/training/precision.py) and the stability statistics
(trainer/training/stability.py).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax

from parallelism.rules import LogicalSharding
from trainer.config import stream_rows
from trainer.model import adapters
from trainer.model.decoder import ModelDef, init_params
from trainer.model.spec import ModelSpec
from trainer.training import clock, precision, stability


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: train steps taken (skipped ones included)
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # raw uint32 key data, so checkpoints hold plain arrays
    clock: dict  # sequences trained on (the schedule's clock) and drawn from the data stream
    loss_scale: dict  # the fp16 loss scale and the good steps since it last changed
    stability: dict  # learning-rate scale, rollbacks and running statistics


_COUNTERS = ("clock", "loss_scale", "stability")


def initial_counters(cfg) -> dict:
    """The clock, loss scale and stability entries of a fresh state."""
    return {
        # Rollbacks skip data: the stream can be ahead of the sequences trained on. Two-word counts
        # (trainer/training/clock.py) in global batches of `batch`, kept beside them for a resume.
        "clock": {
            "sequences": clock.zero(),
            "data_read": clock.zero(),
            "batch": jnp.int32(stream_rows(cfg)),
        },
        "loss_scale": precision.LossScaling.from_config(cfg).initial_state(),
        "stability": stability.initial_state(cfg),
    }


def trained(tree: dict, model: ModelDef) -> dict:
    """The part of a parameter tree that training updates and the state holds: with model.lora its adapters
    (the frozen base is a step input beside the state, never in the optimiser), else all of it."""
    return adapters.split(tree)[0] if model.arch.lora.rank else tree


def frozen(tree: dict, model: ModelDef) -> dict:
    """The frozen base beside the adapters under model.lora; nothing otherwise."""
    return adapters.split(tree)[1] if model.arch.lora.rank else {}


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
    model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, counters: dict
) -> TrainState:
    """Shardings for every array in the state: optimiser moments follow their parameter."""
    rep = shard.replicated()
    params = trained(abstract_params(model, shard), model)
    opt = _optimizer_shardings(tx, jax.eval_shape(tx.init, trained(model.abstract_params, model)), params, rep)
    param_placement = jax.tree.map(lambda p: p.sharding, params)
    return TrainState(rep, param_placement, opt, rep, *(jax.tree.map(lambda _: rep, counters[k]) for k in _COUNTERS))


def _optimizer_shardings(tx, opt_state, params: dict, rep):
    """Optax says which parts of an optimiser's state stand for the parameters (Adam's moments,
    Lion's momentum, Adafactor's statistics); those shaped like their parameter are placed like
    it, the rest (counters, Adafactor's row and column statistics, hyperparameters) replicated.

    optax.tree_map_params cannot see through optax.partition, which Muon's state is made of; there
    a state array whose key path ends with a parameter's path and has its shape follows it.
    """

    def follow(leaf, param):
        return param.sharding if leaf.shape == param.shape else rep

    try:
        return optax.tree_map_params(tx, follow, opt_state, params, transform_non_params=lambda _: rep)
    except ValueError:
        pass
    by_path = {_keys(path): p for path, p in jax.tree_util.tree_leaves_with_path(params)}

    def place(path, leaf):
        keys = _keys(path)
        matches = [by_path[keys[i:]] for i in range(len(keys)) if keys[i:] in by_path]
        return follow(leaf, matches[0]) if matches else rep

    return jax.tree_util.tree_map_with_path(place, opt_state)


def _keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _new_state(params, tx, key, counters) -> TrainState:
    rng = jax.random.key_data(jax.random.fold_in(key, 1))
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rng, **counters)


def create_train_state(
    spec: ModelSpec, model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, seed: int,
    counters: dict,
) -> TrainState:  # fmt: skip
    def init(seed):
        key = jax.random.key(seed)
        return _new_state(trained(init_params(spec, shard, jax.random.fold_in(key, 0)), model), tx, key, counters)

    shardings = state_shardings(model, tx, shard, counters)
    return jax.jit(init, out_shardings=shardings)(jnp.asarray(seed, jnp.uint32))


def state_from_params(
    params: dict, model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, seed: int,
    counters: dict,
) -> TrainState:  # fmt: skip
    """Step 0 of a run that starts from given (sharded) parameters, e.g. imported ones."""
    shardings = state_shardings(model, tx, shard, counters)
    new = jax.jit(lambda p, s: _new_state(p, tx, jax.random.key(s), counters), out_shardings=shardings)
    return new(params, jnp.asarray(seed, jnp.uint32))


def abstract_train_state(
    model: ModelDef, tx: optax.GradientTransformation, shard: LogicalSharding, counters: dict
) -> TrainState:
    """ShapeDtypeStructs carrying their shardings: restore targets and AOT-compile inputs."""
    shapes = jax.eval_shape(lambda p: _new_state(p, tx, jax.random.key(0), counters),
                            trained(model.abstract_params, model))  # fmt: skip
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        state_shardings(model, tx, shard, counters),
    )
