"""Orbax round trips: the whole state and the data position, onto the same or another mesh."""

import jax
import numpy as np
import pytest
from conftest import micro_config

from trainer.config.errors import ConfigError
from trainer.data import streams
from trainer.storage.checkpoint import Checkpointer
from trainer.training.resume import restore_state
from trainer.training.setup import build


def trained_state(cfg, setup, data):
    state, step = setup.new_state(), setup.train_step()
    for _ in range(2):
        state, _ = step(state, streams.to_global(next(data), setup.batch_sharding, cfg.train.global_batch_size))
    return state


@pytest.mark.parametrize(
    "target_mesh,n_devices",
    [(dict(fsdp=8), 8), (dict(fsdp=4, tensor=2), 8), (dict(fsdp=1), 1)],
)
def test_save_then_restore_gives_back_every_array_and_the_data_position(tmp_path, target_mesh, n_devices):
    cfg = micro_config(mesh=dict(fsdp=8))
    setup = build(cfg)
    rows = list(range(cfg.train.global_batch_size))
    data = iter(streams.batches(streams.Stream.from_config(cfg), "train", rows, shuffle=True))
    state = trained_state(cfg, setup, data)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=True)
    ckpt.save(2, state, data)
    ckpt.wait()
    upcoming = next(data)

    target_cfg = micro_config(mesh=target_mesh)
    target = build(target_cfg, jax.devices()[:n_devices])
    fresh = iter(streams.batches(streams.Stream.from_config(target_cfg), "train", rows, shuffle=True))
    restored, *_ = restore_state(ckpt, 2, target, fresh)
    ckpt.close()

    assert int(restored.step) == 2
    for a, b, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(restored), jax.tree.leaves(target.state_shardings), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
        assert b.sharding.is_equivalent_to(sharding, b.ndim)
    np.testing.assert_array_equal(next(fresh)["tokens"], upcoming["tokens"])


def _save_steps(tmp_path, steps=(1, 2, 3), keep=5, keep_every=0):
    cfg = micro_config(mesh=dict(fsdp=8))
    setup = build(cfg)
    data = iter(streams.batches(streams.Stream.from_config(cfg), "train", list(range(8)), shuffle=True))
    state = setup.new_state()
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=keep, keep_every=keep_every)
    for s in steps:
        ckpt.save(s, state.replace(step=state.step + s), data)
    ckpt.wait()
    return cfg, setup, ckpt


def _restorer(cfg, setup, ckpt):
    def restore(step):
        data = iter(streams.batches(streams.Stream.from_config(cfg), "train", list(range(8)), shuffle=True))
        return restore_state(ckpt, step, setup, data)[0]

    return restore


def test_retention_keeps_the_newest_and_every_multiple(tmp_path):
    _, _, ckpt = _save_steps(tmp_path, steps=range(1, 11), keep=2, keep_every=4)
    assert ckpt.steps() == [4, 8, 9, 10]


def test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_used(tmp_path):
    cfg, setup, ckpt = _save_steps(tmp_path)
    ckpt.close()
    data_files = sorted(
        (tmp_path / "checkpoints" / "3" / "params").rglob("ocdbt.process_0/d/*"), key=lambda p: p.stat().st_size
    )
    with open(data_files[-1], "r+b") as f:  # truncate the largest shard file of the newest checkpoint
        f.truncate(data_files[-1].stat().st_size // 2)
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5)
    said = []
    step, state = ckpt.restore_newest_intact(_restorer(cfg, setup, ckpt), said.append, 0)
    assert step == 2 and int(state.step) == 2
    assert "step 3 cannot be read" in said[0]
    assert (tmp_path / "damaged_checkpoints" / "3").is_dir() and ckpt.steps() == [1, 2]


def test_when_every_checkpoint_is_damaged_the_run_stops_instead_of_starting_over(tmp_path):
    cfg, setup, ckpt = _save_steps(tmp_path, steps=(1, 2))
    ckpt.close()
    for step in ("1", "2"):
        (tmp_path / "checkpoints" / step / "params" / "manifest.ocdbt").unlink()
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5)
    with pytest.raises(ConfigError, match="none of the checkpoints .1, 2. .* can be read"):
        ckpt.restore_newest_intact(_restorer(cfg, setup, ckpt), lambda _: None, 0)


def test_a_half_written_save_is_ignored_and_cleaned_up(tmp_path):
    cfg, setup, ckpt = _save_steps(tmp_path, steps=(1, 2))
    ckpt.close()
    leftover = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1234" / "params"
    leftover.mkdir(parents=True)  # what a process killed mid-save leaves behind
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), keep=5)
    assert ckpt.latest_step() == 2
    step, _ = ckpt.restore_newest_intact(_restorer(cfg, setup, ckpt), lambda _: None, 0)
    assert step == 2 and not leftover.exists()


def test_a_checkpoint_of_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    _, _, ckpt = _save_steps(tmp_path, steps=(1,))
    wider = build(micro_config(model=dict(d_ff=256)))
    with pytest.raises(
        ConfigError, match=r"layers.mlp.w_down has shape \(2, 128, 64\) in the checkpoint and \(2, 256, 64\)"
    ):
        ckpt.restore_params(1, wider.model.abstract_params)


def test_parameters_restore_alone_onto_one_device(tmp_path):
    cfg, setup, ckpt = _save_steps(tmp_path, steps=(1,))
    one = build(micro_config(mesh=dict(fsdp=1)), jax.devices()[:1])
    target = one.abstract_state().params
    params = ckpt.restore_params(1, target)
    assert jax.tree.structure(params) == jax.tree.structure(target)
    assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(params))
