"""Config -> mesh, rules, model definition and optimiser, with every check done and nothing written.

Training, planning and evaluation all start here, so a bad config fails the
same way, with one sentence, before anything compiles or touches the disk.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import Mesh, NamedSharding

from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding, check_rules, parse_rules
from trainer.config import check_mesh_fit, validate
from trainer.model.decoder import ModelSpec
from trainer.optim import mup
from trainer.optim.optimizer import make_optimizer
from trainer.optim.schedules import make_schedule
from trainer.training import batch_ramp
from trainer.training.profiling import parse_steps
from trainer.training.stability import Drills, initial_state
from trainer.training.state import ModelDef, TrainState, abstract_train_state, create_train_state, state_shardings
from trainer.training.step import BATCH_NAMES, jit_train_step, make_train_step


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
    stability: dict  # the initial stability state (trainer/training/stability.py)

    def new_state(self) -> TrainState:
        return create_train_state(self.spec, self.model, self.tx, self.shard, self.cfg.train.seed, self.stability)

    def abstract_state(self) -> TrainState:
        return abstract_train_state(self.model, self.tx, self.shard, self.stability)

    def train_step(self, microbatches: int | None = None):
        """The jitted step over `microbatches` (default train.grad_accum_steps) microbatches."""
        k = microbatches or self.cfg.train.grad_accum_steps
        return jit_train_step(make_train_step(self.model, self.tx, self.shard, self.cfg, k), self.state_shardings,
                              self.shard)  # fmt: skip


def build(cfg, devices: list[jax.Device] | None = None) -> Setup:
    validate(cfg)
    make_schedule(cfg.optim, cfg.train.steps)  # refuses schedule phases that do not fit
    mup.check(cfg)
    batch_ramp.check(cfg)
    Drills.from_config(cfg)  # refuses drills that do not parse
    parse_steps(cfg.train.profile_steps)
    mesh = make_mesh(cfg.mesh, devices)
    check_mesh_fit(cfg, mesh)
    rules = parse_rules(cfg.mesh.rules, cfg.mesh.sequence_parallel)
    check_rules(rules, mesh.axis_names)
    shard = LogicalSharding.create(mesh, rules)
    spec = ModelSpec.from_config(cfg)
    model = ModelDef.create(spec, shard)
    tx = make_optimizer(cfg, model.logical_names)
    stability = initial_state(cfg)
    shardings = state_shardings(model, tx, shard, stability)
    return Setup(cfg, mesh, shard, spec, model, tx, shardings, shard.named(BATCH_NAMES), stability)
