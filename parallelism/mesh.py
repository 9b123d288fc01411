"""Build the device mesh from `config.mesh`.

`mesh.stage`, `mesh.data`, `mesh.fsdp`, `mesh.expert`, `mesh.context` and `mesh.tensor` size the axes within one
slice (a TPU slice, or a host of GPUs); `mesh.dcn_data`, `mesh.dcn_fsdp` and `mesh.dcn_context` say how
many slices an axis spans over the slower data-centre network. Tensor parallelism,
the most talkative, stays inside a slice. With several slices the device array
comes from JAX's hybrid-mesh helper: slices are told apart by the devices'
`slice_index` (multi-slice TPU) or, where that is absent or single, by process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from parallelism.config_error import ConfigError

# Outermost to innermost: tensor parallelism talks most, so it gets the
# closest devices (the last axis is laid over neighbours); pipeline stages
# exchange one activation per tick with a neighbour, the least of all. The context axis passes
# keys and values once per layer (trainer/model/context.py): more than FSDP's weights, less than tensor.
# The expert axis exchanges each MoE layer's tokens with an all-to-all (trainer/model/moe.py).
AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
# No stage, expert or tensor parallelism across slices.
DCN_KEYS = (None, "dcn_data", "dcn_fsdp", None, "dcn_context", None)


def resolve_shape(sizes: dict[str, int], n_devices: int) -> tuple[int, ...]:
    """Axis sizes with the one -1 replaced by what is left of the devices."""
    wild = [a for a in AXES if sizes[a] == -1]
    for axis in AXES:
        if sizes[axis] == 0 or sizes[axis] < -1:
            raise ConfigError(f"mesh.{axis}={sizes[axis]}; each mesh size is a positive integer or -1.")
    if len(wild) > 1:
        raise ConfigError(
            f"mesh.{' and mesh.'.join(wild)} are all -1; at most one axis may take the remaining devices."
        )
    fixed = math.prod(sizes[a] for a in AXES if a not in wild)
    if wild:
        if n_devices % fixed:
            raise ConfigError(
                f"the mesh's fixed axes multiply to {fixed}, which does not divide the "
                f"{n_devices} devices; choose sizes whose product divides {n_devices}."
            )
        sizes = {**sizes, wild[0]: n_devices // fixed}
    shape = tuple(sizes[a] for a in AXES)
    if math.prod(shape) != n_devices:
        desc = " x ".join(f"{a}={s}" for a, s in zip(AXES, shape, strict=True))
        raise ConfigError(
            f"the mesh {desc} needs {math.prod(shape)} devices but {n_devices} are available; "
            f"make the sizes multiply to {n_devices} or set one of them to -1."
        )
    return shape


def dcn_shape(mesh_cfg) -> tuple[int, ...]:
    shape = tuple(1 if key is None else int(mesh_cfg[key]) for key in DCN_KEYS)
    if min(shape) < 1:
        given = tuple(s for s, key in zip(shape, DCN_KEYS, strict=True) if key)
        raise ConfigError(f"mesh.dcn_data, mesh.dcn_fsdp and mesh.dcn_context must be positive, not {given}.")
    return shape


def device_array(mesh_cfg, devices: Sequence) -> np.ndarray:
    """Devices laid out as (stage, data, fsdp, expert, context, tensor), slices outermost along the dcn axes."""
    dcn = dcn_shape(mesh_cfg)
    ici_sizes = {a: int(mesh_cfg[a]) for a in AXES}
    if math.prod(dcn) == 1:
        shape = resolve_shape(ici_sizes, len(devices))
        return _on_torus(lambda split: mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split))
    slices = {getattr(d, "slice_index", 0) for d in devices}
    by_slice = len(slices) > 1
    groups = len(slices) if by_slice else len({d.process_index for d in devices})
    if groups != math.prod(dcn):
        unit = "slices" if by_slice else "processes (one per slice)"
        raise ConfigError(
            f"mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_context = {math.prod(dcn)}, but the devices form {groups} "
            f"{unit}; make them multiply to {groups}."
        )
    ici = resolve_shape(ici_sizes, len(devices) // groups)
    return _on_torus(
        lambda split: mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not by_slice, allow_split_physical_axes=split
        )
    )


def _on_torus(create) -> np.ndarray:
    """A TPU slice's devices for the mesh, each axis along whole physical axes of the torus where it can be;
    where it cannot (tensor=2 on v5p-128's 4x4x4), an axis split along one physical axis, as MaxText's
    allow_split_physical_axes does: still neighbours, fewer links."""
    try:
        return create(False)
    except NotImplementedError:
        return create(True)


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all devices (or the given ones) shaped by `config.mesh`."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(device_array(mesh_cfg, devices), AXES, axis_types=(AxisType.Auto,) * len(AXES))
