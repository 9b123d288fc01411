"""Logical axis names -> mesh axes.

Every parameter and constrained activation is named with logical axes
('batch', 'embed', 'mlp', ...). A rule maps each logical axis to zero or more
mesh axes. Rules are resolved per array: a mesh axis already taken by an
earlier dimension of the same array is skipped, so activations named
('batch', 'seq', 'embed') shard batch over (data, fsdp) and leave embed whole,
while parameters named ('embed', 'mlp') shard embed over fsdp.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallelism.config_error import ConfigError

# The default placement: FSDP shards the model dimension of every weight,
# tensor parallelism splits MLP width, heads and vocabulary (Megatron style),
# and the batch is split over every data-parallel axis.
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # The expert axis is data-parallel outside the MoE layers: each of its devices holds other rows.
    "batch": ("data", "fsdp", "expert"),
    # Context parallelism splits every activation along the sequence over mesh.context;
    # attention then sees the other devices' keys and values (trainer/model/context.py).
    "seq": ("context",),
    # The residual stream's sequence axis between blocks (where the norms run);
    # mesh.sequence_parallel adds tensor.
    "residual_seq": ("context",),
    # Weights are sharded over the context axis too: its devices hold different tokens of the same
    # sequences, so their gradients are summed like data parallelism's, and reduce-scattered shards
    # beat an all-reduce of whole ones. Activations' embed stays whole (batch and seq took both axes).
    # The same holds for the expert axis; an expert's weights take it for their expert dimension first.
    "embed": ("fsdp", "context", "expert"),
    "expert": ("expert",),  # an MoE layer's experts (trainer/model/moe.py)
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    # Latent attention's (trainer/model/latent.py) latents: every head reads the whole latent.
    "q_latent": (),
    "kv_latent": (),
    "lora": (),  # a low-rank adapter's rank (trainer/model/primitives.py Adapter): a few columns, kept whole
    # A quantised base's blocks of scales along a weight's inputs (trainer/model/quantised.py): 1/64 of the
    # weight, kept whole, as a block count need not divide the mesh.
    "quant_blocks": (),
    "vocab": ("tensor",),
    # Stacked layers and the pipeline's stage buffers: contiguous blocks of
    # layers per stage (parallelism/pipeline.py); a no-op while mesh.stage = 1.
    "layers": ("stage",),
    "stages": ("stage",),
}


def parse_rules(overrides: Mapping[str, Sequence[str]], sequence_parallel: bool = False) -> dict[str, tuple[str, ...]]:
    """Default rules updated with `mesh.rules` overrides (a tuple of mesh axes each; () for none).

    Sequence parallelism (Megatron's): between blocks the residual stream is
    split along the sequence over the tensor axis, so norms and the residual
    adds hold 1/tensor of the activations; XLA turns the all-reduce after each
    tensor-parallel block into a reduce-scatter and gathers before the next.
    """
    rules = dict(DEFAULT_RULES)
    for name, value in overrides.items():
        if name not in rules:
            raise ConfigError(f"mesh.rules.{name} names no logical axis; known axes are {sorted(rules)}.")
        rules[name] = tuple(value)
    if sequence_parallel:
        rules["residual_seq"] = (*rules["residual_seq"], "tensor")
    return rules


def check_rules(rules: Mapping[str, Sequence[str]], mesh_axes: Sequence[str]) -> None:
    """Refuse rules that name an axis the mesh lacks or use one axis twice for one name."""
    for name, axes in rules.items():
        for axis in axes:
            if axis not in mesh_axes:
                raise ConfigError(
                    f"mesh.rules.{name} maps to mesh axis '{axis}', but the mesh has only "
                    f"{tuple(mesh_axes)}; use one of those or '' to replicate."
                )
        if len(set(axes)) != len(axes):
            raise ConfigError(f"mesh.rules.{name} uses a mesh axis twice ({','.join(axes)}).")


@dataclasses.dataclass(frozen=True)
class LogicalSharding:
    """A mesh plus the rules that place logically named arrays on it.

    With `mesh=None` (a model built outside any mesh, e.g. in a reference test)
    constraints are no-ops.
    """

    mesh: Mesh | None
    rules: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def create(cls, mesh: Mesh | None, rules: Mapping[str, Sequence[str]] | None = None):
        rules = DEFAULT_RULES if rules is None else rules
        return cls(mesh, tuple((k, tuple(v)) for k, v in sorted(rules.items())))

    def spec(self, names: Sequence[str | None]) -> PartitionSpec:
        rules = dict(self.rules)
        used: set[str] = set()
        dims = []
        for name in names:
            axes = (
                tuple(a for a in rules.get(name, ()) if a not in used and self._size(a) > 1) if name is not None else ()
            )
            used.update(axes)
            dims.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*dims)

    def named(self, names: Sequence[str | None]) -> NamedSharding:
        assert self.mesh is not None, "a NamedSharding needs a mesh"
        return NamedSharding(self.mesh, self.spec(names))

    def replicated(self) -> NamedSharding:
        assert self.mesh is not None, "a NamedSharding needs a mesh"
        return NamedSharding(self.mesh, PartitionSpec())

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(names))

    def _size(self, axis: str) -> int:
        # Axes of size one are dropped from specs so that printed shardings stay readable.
        return 1 if self.mesh is None else self.mesh.shape[axis]
