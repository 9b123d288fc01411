"""A frozen base kept quantised (QLoRA; `model.lora.base`): int8 or nf4 weights that the adapters train beside.

Qwix (Google's JAX quantisation library) does the arithmetic: `qwix.quantize` and `qwix.dequantize`. Each
projection weight the adapter targets can name (attention's wq, wk, wv, wo and an output gate's wg; the gated
MLP's w_gate, w_up, w_down, in dense layers and a mixture's shared experts; a Gated DeltaNet layer's wq, wk,
wv, wz, wb, wa and wo, every nn.Linear of transformers' layer, as bitsandbytes would) is stored as its
quantised values under its own name with its scales beside it under `<name>_scale`, whatever
model.lora.targets adapts, as QLoRA quantises every linear layer. Embeddings, the head, norms, routers,
routed experts, latent attention and a Gated DeltaNet layer's convolution and decay parameters keep their
dtype.

- int8: one scale per output channel, the absolute maximum over the weight's inputs (Qwix's symmetric int8,
  which maps it to 127.5 and clips to [-128, 127]).
- nf4: 4-bit NormalFloat (the QLoRA paper's 16 levels), one fp32 absolute maximum per block of 64 inputs
  along the weight's last input axis (the whole axis where it is not a multiple of 64): bitsandbytes'
  blocks of a torch [out, in] weight, so a model imported from Hugging Face gets the base PEFT's QLoRA does.
  Two codes are packed a byte (uint8) along that axis.

A checkpoint holds the base as trained (checkpoint.init_from's weights); it is read into host memory and
quantised onto the devices a layer at a time, the same way every time, so a resumed run sees the same base
bits and the devices never hold the base at full precision. A layer dequantises one weight at a time, in
its scan, so no whole-precision copy of the base exists.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from trainer.config.errors import ConfigError

SCALE = "_scale"
BLOCK = 64
# How many of a weight's axes are its inputs and, after them, its outputs; axes before both are stacked
# layers'. The quantised weights are these.
AXES = {
    "wq": (1, 2),
    "wk": (1, 2),
    "wv": (1, 2),
    "wo": (2, 1),
    "w_gate": (1, 1),
    "w_up": (1, 1),
    "w_down": (1, 1),
    "wg": (1, 2),
    "wz": (1, 2),
    "wb": (1, 1),
    "wa": (1, 1),
}  # wg: attention's gate; wz, wb, wa: delta.py's
QTYPES = {"int8": jnp.int8, "nf4": "nf4"}


def _how(name: str, shape: tuple, scheme: str) -> tuple[list[int], dict[int, int]]:
    """Qwix's (channelwise axes, tiled axes) for weight `name` of `shape` under `scheme`."""
    n_in, n_out = AXES[name]
    lead = len(shape) - n_in - n_out
    inputs = range(lead, lead + n_in)
    if scheme == "int8":  # a scale per output channel (and per stacked layer)
        return [i for i in range(len(shape)) if i not in inputs], {}
    last = lead + n_in - 1
    block = BLOCK if shape[last] % BLOCK == 0 else shape[last]
    return [i for i in range(len(shape)) if i != last], {last: block}


def quantise(w: jax.Array, name: str, scheme: str) -> tuple[jax.Array, jax.Array]:
    """(stored values, scales) of weight `name`: int8 values, or nf4 codes packed two a byte along the
    blocked axis (the first of a pair in the high half), as a 4-bit array crosses no program boundary
    on XLA:CPU's several devices."""
    channelwise, tiled = _how(name, w.shape, scheme)
    q = qwix.quantize(w.astype(jnp.float32), QTYPES[scheme], channelwise_axes=channelwise, tiled_axes=tiled)
    if scheme == "int8":
        return q.qvalue, q.scale
    (axis,) = tiled
    if w.shape[axis] % 2:
        raise ConfigError(f"model.lora.base=nf4 packs two 4-bit values a byte along {name}'s inputs, which "
                          f"number {w.shape[axis]} here; use an even size or model.lora.base=int8.")  # fmt: skip
    codes = q.qvalue.astype(jnp.uint8)
    pairs = codes.reshape(*w.shape[:axis], w.shape[axis] // 2, 2, *w.shape[axis + 1 :])
    first, second = jnp.moveaxis(pairs, axis + 1, 0)
    return (first << 4) | second, q.scale


def unpacked_shape(name: str, values) -> tuple:
    """The weight's own shape, from its stored values' (nf4's hold two a byte along the blocked axis)."""
    if values.dtype == jnp.int8:
        return tuple(values.shape)
    (axis,) = _how(name, values.shape, "nf4")[1]
    return (*values.shape[:axis], 2 * values.shape[axis], *values.shape[axis + 1 :])


def dequantise(values: jax.Array, scale: jax.Array, name: str) -> jax.Array:
    """fp32 weight `name` from `quantise`'s (values, scales)."""
    if values.dtype == jnp.int8:
        return qwix.dequantize(qwix.QArray(values, scale.astype(jnp.float32)))
    (axis,) = _how(name, values.shape, "nf4")[1]
    codes = jnp.stack([values >> 4, values & 15], axis=axis + 1).reshape(unpacked_shape(name, values))
    return qwix.dequantize(qwix.QArray(codes.astype(jnp.uint4), scale.astype(jnp.float32), qtype="nf4"))


def scale_names(name: str, names: tuple, scheme: str) -> tuple:
    """The scales' logical axes: the weight's, with an axis the scales do not split (int8's inputs) unnamed,
    and nf4's blocks on `quant_blocks` (parallelism/rules.py: whole, as a weight's block count need not
    divide the mesh)."""
    channelwise, tiled = _how(name, (1,) * len(names), scheme)
    return tuple(n if i in channelwise else "quant_blocks" if i in tiled else None for i, n in enumerate(names))


def store(module: nnx.Module, name: str, scheme: str) -> None:
    """Replace `module`'s float weight `name` with its quantised values and their scales."""
    param = getattr(module, name)
    names = param.get_metadata()["out_sharding"]
    values, scale = quantise(param[...], name, scheme)
    setattr(module, name, nnx.Param(values, sharding_names=names, eager_sharding=False))
    setattr(module, name + SCALE, nnx.Param(scale, sharding_names=scale_names(name, names, scheme),
                                            eager_sharding=False))  # fmt: skip


def weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """`module`'s weight `name` in `dtype`, dequantised where the base is stored quantised."""
    w = getattr(module, name)[...]
    scale = getattr(module, name + SCALE, None)
    if scale is None:
        return w.astype(dtype)
    return dequantise(w, scale[...], name).astype(dtype)


def _map(tree: dict, leaf) -> dict:
    """`tree` with each quantised weight's pair (values, scale) replaced by `leaf(name, values, scale)`."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out[key] = _map(value, leaf)
        elif str(key).endswith(SCALE):
            continue
        elif str(key) + SCALE in tree:
            out[key] = leaf(str(key), value, tree[str(key) + SCALE])
        else:
            out[key] = value
    return out


def held(tree: dict) -> list:
    """The quantised weights' stored values and scales in `tree`, as a list of leaves."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += held(value)
        elif str(key).endswith(SCALE) or str(key) + SCALE in tree:
            out.append(value)
    return out


def is_quantised(tree: dict) -> bool:
    return bool(held(tree))


def as_stored(abstract: dict, dtype=jnp.float32) -> dict:
    """The tree a checkpoint holds for a quantised `abstract` tree (shapes and shardings): each weight in
    `dtype` with its quantised values' shape and sharding, and no scales."""
    return _map(abstract, lambda name, v, s: jax.ShapeDtypeStruct(unpacked_shape(name, v), dtype, sharding=v.sharding))


def on_host(abstract: dict) -> dict:
    """`abstract` (as_stored's form) placed whole in this process's host memory (its first CPU device): where a
    checkpoint's base is read before quantise_tree moves it to the devices a layer at a time, so the base at
    full precision never sits on them whole (an 8B model's 32 GB of fp32 beside a 16 GB chip)."""
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), abstract)


def quantise_tree(floats: dict, abstract: dict) -> dict:
    """`floats` (as_stored's form, on the host or the devices) quantised into `abstract`'s form and shardings,
    a stacked weight one layer at a time; the other weights placed as `abstract` says."""
    out = {}
    for key, spec in abstract.items():
        if isinstance(spec, dict):
            out[key] = quantise_tree(floats[key], spec)
        elif str(key) + SCALE in abstract:
            scale, scheme = abstract[str(key) + SCALE], "int8" if spec.dtype == jnp.int8 else "nf4"
            out[key], out[str(key) + SCALE] = _by_layer(floats[key], str(key), scheme, spec, scale)
        elif not str(key).endswith(SCALE):
            out[key] = jax.device_put(floats[key], spec.sharding)
    return out


def _by_layer(w: jax.Array, name: str, scheme: str, spec, scale) -> tuple[jax.Array, jax.Array]:
    """(values, scales) of weight `name`, quantised a layer at a time where it is stacked (a layer's values
    and scales are those of the stack's slice: every scale is within a layer)."""
    lead = len(w.shape) - sum(AXES[name])
    if lead == 0:
        place = jax.jit(functools.partial(quantise, name=name, scheme=scheme),
                        out_shardings=(spec.sharding, scale.sharding))  # fmt: skip
        return place(jax.device_put(w, spec.sharding))
    one = lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))  # noqa: E731
    place = jax.jit(functools.partial(quantise, name=name, scheme=scheme),
                    out_shardings=(one(spec.sharding), one(scale.sharding)))  # fmt: skip
    pieces = [place(jax.device_put(w[i], one(spec.sharding))) for i in range(w.shape[0])]
    stack = lambda sharding: jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)  # noqa: E731
    return (stack(spec.sharding)(*[v for v, _ in pieces]), stack(scale.sharding)(*[s for _, s in pieces]))


def dequantised(tree: dict) -> dict:
    """A tree with every quantised weight back in fp32 (what an export merges its adapters into)."""
    return _map(tree, lambda name, v, s: dequantise(jnp.asarray(v), jnp.asarray(s), name))
