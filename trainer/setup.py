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
from trainer.model import ModelSpec
from trainer.optimizer import make_optimizer
from trainer.schedules import make_schedule
from trainer.state import ModelDef, TrainState, state_shardings
from trainer.step import BATCH_NAMES


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


def build(cfg, devices: list[jax.Device] | None = None) -> Setup:
    validate(cfg)
    make_schedule(cfg.optim, cfg.train.steps)  # refuses schedule phases that do not fit
    mesh = make_mesh(cfg.mesh, devices)
    check_mesh_fit(cfg, mesh)
    rules = parse_rules(cfg.mesh.rules, cfg.mesh.sequence_parallel)
    check_rules(rules, mesh.axis_names)
    shard = LogicalSharding.create(mesh, rules)
    spec = ModelSpec.from_config(cfg)
    model = ModelDef.create(spec, shard)
    tx = make_optimizer(cfg)
    return Setup(cfg, mesh, shard, spec, model, tx, state_shardings(model, tx, shard), shard.named(BATCH_NAMES))
