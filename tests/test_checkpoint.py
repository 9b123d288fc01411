"""Orbax round trips: the whole state and the data position, onto the same or another mesh."""

import jax
import numpy as np
import pytest
from conftest import micro_config

from trainer.checkpoint import Checkpointer
from trainer.data import pipeline
from trainer.setup import build
from trainer.state import abstract_train_state, create_train_state
from trainer.step import jit_train_step, make_train_step


def trained_state(cfg, setup, data):
    state = create_train_state(setup.spec, setup.model, setup.tx, setup.shard, 0)
    step = jit_train_step(make_train_step(setup.model, setup.tx, setup.shard, 1), setup.state_shardings, setup.shard)
    for _ in range(2):
        state, _ = step(state, pipeline.to_global(next(data), setup.batch_sharding, cfg.train.global_batch_size))
    return state


@pytest.mark.parametrize(
    "target_mesh,n_devices",
    [(dict(fsdp=8), 8), (dict(fsdp=4, tensor=2), 8), (dict(fsdp=1), 1)],
)
def test_save_then_restore_gives_back_every_array_and_the_data_position(tmp_path, target_mesh, n_devices):
    cfg = micro_config(mesh=dict(fsdp=8))
    setup = build(cfg)
    rows = list(range(cfg.train.global_batch_size))
    data = iter(pipeline.batches(cfg, "train", rows, shuffle=True))
    state = trained_state(cfg, setup, data)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
    ckpt.save(2, state, data)
    ckpt.wait()
    upcoming = next(data)

    target_cfg = micro_config(mesh=target_mesh)
    target = build(target_cfg, jax.devices()[:n_devices])
    fresh = iter(pipeline.batches(target_cfg, "train", rows, shuffle=True))
    restored = ckpt.restore(2, abstract_train_state(target.model, target.tx, target.shard), fresh)
    ckpt.close()

    assert int(restored.step) == 2
    for a, b, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(target.state_shardings), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
        assert b.sharding.is_equivalent_to(sharding, b.ndim)
    np.testing.assert_array_equal(next(fresh)["tokens"], upcoming["tokens"])
