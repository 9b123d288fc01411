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

from parallelism.chips import CHIPS, chip_of
from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding, parse_rules
from trainer.config.errors import ConfigError
from trainer.model import adapters
from trainer.model.attention import context_kernel, resolve
from trainer.model.context import ways
from trainer.model.decoder import ModelDef
from trainer.model.flops import count_params, flops_per_token, forward_flops, inactive_params
from trainer.model.spec import ModelSpec, for_inference
from trainer.optim.optimizer import make_optimizer
from trainer.training.mesh_fit import check_adapters, check_mesh_fit, check_weights_fit
from trainer.training.state import (
    TrainState,
    abstract_params,
    abstract_train_state,
    create_train_state,
    frozen,
    initial_counters,
    state_shardings,
    trained,
)
from trainer.training.step import BATCH_NAMES, abstract_batch, batch_keys, jit_train_step, make_train_step
from trainer.training.teacher import teacher_config
from trainer.training.validation import validate


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
    teacher: Setup | None = None  # distillation's online teacher on the same mesh (trainer/training/teacher.py)

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
        inputs = tuple(jax.tree.map(lambda a: a.sharding, x) for x in self.step_inputs())
        teacher = self.teacher.inference_model if self.teacher is not None else None
        step = make_train_step(self.model, self.tx, self.shard, self.cfg, k, teacher)
        return jit_train_step(step, self.state_shardings, self.shard, batch_keys(self.cfg), inputs)

    @property
    def preference(self) -> bool:
        return self.cfg.data.format == "preference"

    @property
    def adapted(self) -> bool:
        """Whether only low-rank adapters train (model.lora.rank > 0), beside a frozen base."""
        return self.model.arch.lora.rank > 0

    def step_inputs(self) -> tuple:
        """The train step's inputs after the batch, as shapes and shardings: the frozen base under
        model.lora (DPO's reference too: the base with the adapters switched off), DPO's reference
        parameters, or none; then an online teacher's parameters, where the run distils from one."""
        teacher = (self.teacher.abstract_params(),) if self.teacher is not None else ()
        if self.adapted:
            return (frozen(self.abstract_params(), self.model), *teacher)
        return ((self.abstract_params(),) if self.preference else ()) + teacher

    def describe(self, flops_per_token: float) -> list[str]:
        """The model's lines in a run's start-up log: its size, cost and mesh; under model.lora what trains
        (the adapters alone, as a share of the frozen base: the optimiser's state is theirs only)."""
        counts = count_params(self.model.abstract_params)
        inactive = inactive_params(self.spec.arch, self.model.abstract_params)
        active = f", {(counts['total'] - inactive) / 1e6:.2f}M active per token" if inactive else ""
        mesh = dict(self.mesh.shape)
        lines = [f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['non_embedding'] / 1e6:.2f}M "
                 f"non-embedding{active}), {flops_per_token / 1e6:.1f} MFLOPs/token; mesh {mesh}"]  # fmt: skip
        c = self.cfg
        quant = f", {c.model.quant.matmul} matmuls in {','.join(c.model.quant.targets)}" if c.model.quant.matmul else ""
        lines.append(f"precision: {c.precision.compute_dtype} compute{quant}, {c.precision.param_dtype} weights")
        if self.adapted:
            added = sum(x.size for x in jax.tree.leaves(trained(self.model.abstract_params, self.model)))
            base, lora = counts["total"] - added, self.cfg.model.lora
            stored, on = f", its projections stored {lora.base}" if lora.base else "", ",".join(lora.targets)
            lines.append(f"trainable: {added / 1e6:.3f}M adapter parameters ({100 * added / base:.3f}% of the "
                         f"frozen model's {base / 1e6:.2f}M{stored}), rank {lora.rank} on {on}")  # fmt: skip
        return lines

    def flops_per_token(self) -> float:
        """Training FLOPs per token (model/flops.py), with an online teacher's forward pass."""
        fpt = flops_per_token(self.spec.arch, self.model.abstract_params, self.cfg.data.seq_len, self.preference)
        if self.teacher is not None:
            fpt += forward_flops(self.teacher.spec.arch, self.teacher.model.abstract_params, self.cfg.data.seq_len)
        return fpt

    def abstract_params(self) -> dict:
        """Every parameter the model applies (with model.lora: base and adapters), as shapes and shardings."""
        return abstract_params(self.model, self.shard)

    def weights(self, params: dict, inputs: tuple) -> dict:
        """The parameters the model applies, from the state's and the step's inputs: the adapters joined to
        the frozen base under model.lora, else the state's own."""
        return adapters.join(params, inputs[0]) if self.adapted else params

    def reference(self, weights: dict, inputs: tuple) -> dict:
        """DPO's reference for `weights`: under model.lora the same base with the adapters switched off (no
        second copy of the weights), else the step's input."""
        if self.adapted:
            added, base = adapters.split(weights)
            return adapters.join(adapters.switched_off(added), base)
        return inputs[0]

    def abstract_batch(self, size: int | None = None, training: bool = True) -> dict:
        """A batch of `size` (default train.global_batch_size) sequences, as shapes and shardings; a training
        batch, or a held-out one (step.batch_keys)."""
        size = size or self.cfg.train.global_batch_size
        return abstract_batch(size, self.cfg.data.seq_len, self.batch_sharding, batch_keys(self.cfg, training),
                              self.cfg.distill.top_k)  # fmt: skip


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
    chip = chip_of(mesh.devices.flat[0].device_kind)
    if spec.execution.quant_matmul == "fp8" and chip is not None and not CHIPS[chip].fp8_ops:
        raise ConfigError(f"model.quant.matmul=fp8 on {chip}, which has no fp8 matmul units; use "
                          "model.quant.matmul=int8.")  # fmt: skip
    spec = dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, attention=kernel))
    model = ModelDef.create(spec, shard)
    check_weights_fit(model, shard)
    check_adapters(model)
    tx = make_optimizer(cfg, trained(model.logical_names, model))
    counters = initial_counters(cfg)
    shardings = state_shardings(model, tx, shard, counters)
    taught = teacher_config(cfg) if cfg.distill.mode == "online" else None
    teacher = build(taught, list(mesh.devices.flat)) if taught is not None else None
    return Setup(cfg, mesh, shard, spec, model, tx, shardings, shard.named(BATCH_NAMES), counters, teacher)
