"""Build the device mesh from `config.mesh`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from trainer.errors import ConfigError

# Outermost to innermost: tensor parallelism talks most, so it gets the
# closest devices (jax.make_mesh lays the last axis over neighbours).
AXES = ("data", "fsdp", "tensor")


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


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all devices (or the given ones) shaped by `mesh.data/fsdp/tensor`."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape({a: int(mesh_cfg[a]) for a in AXES}, len(devices))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
