"""Config -> mesh, rules, model definition and optimiser, with every check done and nothing written.

Training, planning and evaluation all start here, so a bad config fails the
same way, with one sentence, before anything compiles or touches the disk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding, parse_rules
from trainer.config.errors import ConfigError
from trainer.model.attention import context_kernel, resolve
from trainer.model.context import ways
from trainer.model.decoder import ModelDef
from trainer.model.spec import ModelSpec, for_inference
from trainer.optim.optimizer import make_optimizer
from trainer.training.state import (
    TrainState,
    abstract_params,
    abstract_train_state,
    create_train_state,
    initial_counters,
    param_shardings,
    state_shardings,
)
from trainer.training.step import BATCH_NAMES, abstract_batch, batch_keys, jit_train_step, make_train_step
from trainer.training.validation import check_mesh_fit, check_weights_fit, validate


@dataclasses.dataclass(frozen=True)
class Setup:
    cfg: object
    mesh: Mesh
    shard: LogicalSharding
    spec: ModelSpec
    model: ModelDef
    tx: optax.GradientTransformation
    state_shardings: TrainState
    batch_sharding: NamedSharding
    counters: dict  # a fresh state's clock, loss scale and stability entries (trainer/training/state.py)

    @functools.cached_property
    def inference_model(self) -> ModelDef:
        """The model that scores, evaluates and decodes the same parameters (spec.for_inference)."""
        spec = for_inference(self.spec)
        return self.model if spec is self.spec else ModelDef.create(spec, self.shard)

    def new_state(self) -> TrainState:
        return create_train_state(self.spec, self.model, self.tx, self.shard, self.cfg.train.seed, self.counters)

    def abstract_state(self) -> TrainState:
        return abstract_train_state(self.model, self.tx, self.shard, self.counters)

    def train_step(self, microbatches: int | None = None):
        """The jitted step over `microbatches` (default train.grad_accum_steps) microbatches; it takes the
        state, the batch and `step_inputs()`."""
        k = microbatches or self.cfg.train.grad_accum_steps
        reference = param_shardings(self.model, self.shard) if self.preference else None
        return jit_train_step(make_train_step(self.model, self.tx, self.shard, self.cfg, k), self.state_shardings,
                              self.shard, batch_keys(self.cfg), reference)  # fmt: skip

    @property
    def preference(self) -> bool:
        return self.cfg.data.format == "preference"

    def step_inputs(self) -> tuple:
        """The train step's inputs after the batch, as shapes and shardings: DPO's reference parameters, or
        none."""
        return (abstract_params(self.model, self.shard),) if self.preference else ()

    def abstract_batch(self, size: int | None = None) -> dict:
        """A batch of `size` (default train.global_batch_size) sequences, as shapes and shardings."""
        size = size or self.cfg.train.global_batch_size
        return abstract_batch(size, self.cfg.data.seq_len, self.batch_sharding, batch_keys(self.cfg))


def build(cfg, devices: list[jax.Device] | None = None) -> Setup:
    validate(cfg)
    mesh = make_mesh(cfg.mesh, devices)
    check_mesh_fit(cfg, mesh)
    shard = LogicalSharding.create(mesh, parse_rules(cfg.mesh.rules, cfg.mesh.sequence_parallel))
    spec = ModelSpec.from_config(cfg)
    # 'auto' attention becomes the kernel for these devices here, so the planner's arithmetic and
    # every report name the kernel that runs.
    # With a context axis: a fused kernel over the gathered keys, or XLA's blocks (attention.context_kernel).
    e, platform = spec.execution, mesh.devices.flat[0].platform
    split = ways(shard) > 1
    kernel = context_kernel(e.attention, e.context_attention, platform) if split else resolve(e.attention, platform)
    if spec.arch.attention_sinks and (kernel not in ("xla", "splash") or (split and kernel == "xla")):
        where = f"over mesh.context={ways(shard)}" if split else f"on {platform}"
        raise ConfigError(f"model.attention_sinks with model.attention={e.attention} ({kernel} {where}): only the xla "
                          "and splash kernels take sinks here, and not through the context axis's blocks; use "
                          "model.attention=xla or splash.")  # fmt: skip
    spec = dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, attention=kernel))
    model = ModelDef.create(spec, shard)
    check_weights_fit(model, shard)
    tx = make_optimizer(cfg, model.logical_names)
    counters = initial_counters(cfg)
    shardings = state_shardings(model, tx, shard, counters)
    return Setup(cfg, mesh, shard, spec, model, tx, shardings, shard.named(BATCH_NAMES), counters)
