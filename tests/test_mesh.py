"""Mesh construction: axis sizes, multi-slice (DCN) layouts, and the misfits refused."""

import dataclasses

import jax
import ml_collections
import numpy as np
import pytest
from conftest import micro_config

from parallelism.mesh import AXES, device_array, make_mesh
from parallelism.rules import LogicalSharding, check_rules, parse_rules
from trainer.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What the hybrid-mesh helper reads of a device: a multi-slice TPU's slice index."""

    id: int
    slice_index: int
    process_index: int = 0
    platform: str = "cpu"
    device_kind: str = "fake"


def mesh_cfg(**sizes):
    sizes = {"stage": 1, "data": 1, "fsdp": -1, "expert": 1, "context": 1, "tensor": 1, "dcn_data": 1, "dcn_fsdp": 1,
             "dcn_context": 1, **sizes}  # fmt: skip
    return ml_collections.ConfigDict(sizes)


def test_minus_one_takes_the_rest():
    shape = {"stage": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    assert dict(make_mesh(mesh_cfg(tensor=2)).shape) == shape


def test_data_across_slices_keeps_every_slice_whole():
    devices = [FakeDevice(i, slice_index=i // 8) for i in range(16)]
    array = device_array(mesh_cfg(tensor=2, dcn_data=2), devices)
    assert array.shape == (1, 2, 4, 1, 1, 2)  # stage 1, data = 2 slices x 1, fsdp 4 and tensor 2 inside each
    slices = np.vectorize(lambda d: d.slice_index)(array)[0, :, :, 0, 0]
    assert (slices[0] == 0).all() and (slices[1] == 1).all()  # only the data axis crosses the slower network


def test_fsdp_across_slices_splits_the_fsdp_axis_by_slice():
    devices = [FakeDevice(i, slice_index=i // 4) for i in range(16)]
    array = device_array(mesh_cfg(fsdp=2, tensor=2, dcn_fsdp=4), devices)
    assert array.shape == (1, 1, 8, 1, 1, 2)
    slices = np.vectorize(lambda d: d.slice_index)(array)[0, 0, :, 0, 0]
    assert [set(slices[i : i + 2].ravel()) for i in range(0, 8, 2)] == [{0}, {1}, {2}, {3}]


def test_context_across_slices_splits_the_context_axis_by_slice():
    devices = [FakeDevice(i, slice_index=i // 4) for i in range(8)]
    array = device_array(mesh_cfg(fsdp=2, context=2, tensor=1, dcn_context=2), devices)
    assert array.shape == (1, 1, 2, 1, 4, 1)
    slices = np.vectorize(lambda d: d.slice_index)(array)[0, 0, :, 0]
    assert all(set(slices[:, i : i + 2].ravel()) == {i // 2} for i in (0, 2))  # each slice holds two of the four


def test_dcn_sizes_must_match_the_slices_present():
    with pytest.raises(ConfigError, match="dcn_context = 2, but the devices form 1 processes"):
        make_mesh(mesh_cfg(dcn_data=2))
    devices = [FakeDevice(i, slice_index=i // 4) for i in range(16)]
    with pytest.raises(ConfigError, match="= 2, but the devices form 4 slices"):
        device_array(mesh_cfg(dcn_data=2), devices)


def test_rules_must_name_axes_the_mesh_has_and_use_each_once():
    with pytest.raises(ConfigError, match="mesh axis 'model'"):
        check_rules(parse_rules({"mlp": ("model",)}), AXES)
    with pytest.raises(ConfigError, match="uses a mesh axis twice"):
        check_rules(parse_rules({"batch": ("data", "data")}), AXES)
    with pytest.raises(ConfigError, match="names no logical axis"):
        parse_rules({"hidden": ("tensor",)})


def test_sequence_parallelism_splits_the_residual_stream_over_tensor():
    mesh = make_mesh(mesh_cfg(fsdp=4, tensor=2))
    plain = LogicalSharding.create(mesh, parse_rules({}))
    sp = LogicalSharding.create(mesh, parse_rules({}, sequence_parallel=True))
    residual = ("batch", "residual_seq", "embed")
    assert plain.spec(residual) == jax.sharding.PartitionSpec("fsdp", None, None)
    assert sp.spec(residual) == jax.sharding.PartitionSpec("fsdp", "tensor", None)


def test_sequence_parallelism_saves_activation_memory():
    from trainer.planning.plan import plan

    def temporaries(sp):
        cfg = micro_config(model=dict(n_heads=8, n_kv_heads=8, d_model=128, d_ff=256), mesh=dict(fsdp=2, tensor=4))
        cfg.mesh.sequence_parallel = sp
        cfg.data.seq_len = 64
        return plan(cfg)["compiled_breakdown"]["temporaries"]

    assert temporaries(True) < 0.95 * temporaries(False)
