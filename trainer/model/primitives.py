"""The parts every layer is built from: a parameter with its logical axis names, a low-rank adapter, RMSNorm,
rotary position embeddings, and the gated MLP. They sit below every block that uses them (layers.py's
attention and block, latent.py's latent attention, moe.py's shared experts, mtp.py's modules), which import
them from here alone.

Parameters stay in fp32; each matmul runs in the execution's compute dtype, while norms are fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.config import ADAPTER_TARGETS
from trainer.model import quantised
from trainer.model.low_precision import einsum
from trainer.model.quantised import weight
from trainer.model.spec import Adapters, ModelSpec, RopeScaling


def param(rngs: nnx.Rngs, shape, names, std: float) -> nnx.Param:
    # eager_sharding=False: placement is decided once, by jit out_shardings, not at creation.
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, sharding_names=names, eager_sharding=False)


class Adapter(nnx.Module):
    """A low-rank update beside a frozen weight W (LoRA): x -> (alpha / rank) * (x . A) . B, where A is
    (W's inputs..., rank) and B (rank, W's outputs...), each sharded by the logical axes of the part of W it
    stands for (the rank's axis: `lora`, whole by default). B starts at zero, so an adapted model starts as
    its base; A starts as PEFT's does, uniform in +-1/sqrt(fan_in). `x . A` contracts x's last dims with
    A's input dims, as the projection contracts them with W's. Given a `key` (a training step's), x is
    dropped out first at rate `dropout` (model.lora.dropout), as PEFT drops the adapter's input."""

    def __init__(self, rngs: nnx.Rngs, lora: Adapters, inputs: tuple, input_names: tuple, outputs: tuple,
                 output_names: tuple, dropout: float = 0.0):  # fmt: skip
        bound = 1 / math.prod(inputs) ** 0.5
        a = jax.random.uniform(rngs.params(), (*inputs, lora.rank), jnp.float32, -bound, bound)
        self.a = nnx.Param(a, sharding_names=(*input_names, "lora"), eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((lora.rank, *outputs), jnp.float32), sharding_names=("lora", *output_names),
                           eager_sharding=False)  # fmt: skip
        self.scale, self.n_inputs, self.dropout = lora.alpha / lora.rank, len(inputs), dropout

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        if key is not None and self.dropout:
            keep = jax.random.bernoulli(key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1 - self.dropout, x.dtype), jnp.zeros((), x.dtype))
        down = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.n_inputs)
        return jnp.tensordot(down, self.b[...].astype(x.dtype), axes=1) * jnp.asarray(self.scale, x.dtype)


def update(module: nnx.Module, target: str, x: jax.Array, key: jax.Array | None = None) -> jax.Array | None:
    """The adapter's update for `target`'s projection of `x`, None where it has none (`key`: the layer's
    dropout key, None outside training)."""
    adapter = getattr(module, f"lora_{target}", None)
    if adapter is None:
        return None
    return adapter(x, None if key is None else jax.random.fold_in(key, ADAPTER_TARGETS.index(target)))


def adapted(module: nnx.Module, target: str, y: jax.Array, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """A projection's output `y` of `x`, plus its adapter's update where `target` has one."""
    added = update(module, target, x, key)
    return y if added is None else y + added


class RMSNorm(nnx.Module):
    """x / rms(x) times a gain: the weight, or with `centred` (model.centred_norms: Qwen3.5's form) 1 + the
    weight, which starts at 0, so that the weight is the file's exactly."""

    def __init__(self, dim: int, eps: float, axis: str = "embed", centred: bool = False):
        start = jnp.zeros((dim,), jnp.float32) if centred else jnp.ones((dim,), jnp.float32)
        self.scale = nnx.Param(start, sharding_names=(axis,), eager_sharding=False)
        self.eps, self.offset = eps, 1.0 if centred else 0.0

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        gain = self.scale[...] + self.offset if self.offset else self.scale[...]
        return (x32 * gain).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """The rotation frequencies of the head_dim/2 pairs, with Llama 3's scaling for long context: a pair
    whose wavelength exceeds original_max_len / low_freq_factor turns `factor` times slower (positions up to
    factor x the original length look like the original's), one shorter than original_max_len /
    high_freq_factor keeps its frequency (local order stays sharp), and those between blend the two."""
    freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling.factor == 1:
        return freq
    if scaling.kind == "yarn":
        return _yarn(freq, head_dim, theta, scaling)
    wavelength = 2 * jnp.pi / freq
    low, high, original = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_len
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * freq / scaling.factor + blend * freq
    return jnp.where(wavelength > original / low, freq / scaling.factor,
                     jnp.where(wavelength < original / high, freq, blended))  # fmt: skip


def _yarn(freq: jax.Array, head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """YaRN's frequencies: pairs that turn more than beta_fast times over the original length keep theirs, those
    turning fewer than beta_slow times are slowed by `factor`, and those between blend linearly by pair index."""

    def pair(turns: float) -> float:  # the pair index that turns `turns` times over the original length
        return head_dim * math.log(scaling.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(scaling.beta_fast), pair(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low if high != low else 1e-3), 0, 1)
    return freq / scaling.factor * ramp + freq * (1 - ramp)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling):
    """cos and sin of shape (batch, seq, 1, head_dim/2) for the given positions (times YaRN's attention factor)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta, scaling)
    factor = scaling.attention_factor
    return factor * jnp.cos(angles)[:, :, None, :], factor * jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, tables) -> jax.Array:
    """Rotate pairs (i, i + rotated/2), the layout Hugging Face's Llama uses, over the first `rotated` dims
    (twice the tables' width: all of a head, or its first model.rope_fraction); the rest pass unrotated."""
    cos, sin = tables
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotated], tables), x[..., rotated:]], axis=-1)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs, width: int = 0):
        a, std = spec.arch, spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5
        width = width or a.d_ff
        self.w_gate = param(rngs, (a.d_model, width), ("embed", "mlp"), std)
        self.w_up = param(rngs, (a.d_model, width), ("embed", "mlp"), std)
        self.w_down = param(rngs, (width, a.d_model), ("mlp", "embed"), out_std)
        for name, shape, names in (("gate", (a.d_model, width), ("embed", "mlp")),
                                   ("up", (a.d_model, width), ("embed", "mlp")),
                                   ("down", (width, a.d_model), ("mlp", "embed"))):  # fmt: skip
            if a.lora.on(name):
                setattr(self, f"lora_{name}", Adapter(rngs, a.lora, shape[:1], names[:1], shape[1:], names[1:],
                                                      spec.execution.adapter_dropout))  # fmt: skip
        for name in ("w_gate", "w_up", "w_down") if a.lora.quantised else ():
            quantised.store(self, name, a.lora.quantised)
        self.activation = a.mlp_activation
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x, key=None):
        """`key`: the adapters' dropout key (training steps only)."""
        dt = self.execution.compute_dtype
        run = self.execution
        gate = adapted(self, "gate", einsum("...d,df->...f", x, weight(self, "w_gate", dt), run, "mlp"), x, key)
        up = adapted(self, "up", einsum("...d,df->...f", x, weight(self, "w_up", dt), run, "mlp"), x, key)
        hidden = self.shard.constrain(ACTIVATIONS[self.activation](gate) * up, ("batch", "seq", "mlp"))
        down = einsum("...f,fd->...d", hidden, weight(self, "w_down", dt), run, "mlp")
        return adapted(self, "down", down, hidden, key)
