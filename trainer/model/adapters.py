"""A parameter tree's low-rank adapters (primitives.py Adapter, under keys `lora_<target>`) apart from the
frozen weights they adapt, and back: training keeps the adapters in its state and the base beside it, and an
export folds each adapter into its weight.

Trees are NNX's pure nested dicts. A projection's weight and its adapter are siblings: `wq` beside
`lora_q` = {"a": A, "b": B}, with any leading stacked-layer axes on all three.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

PREFIX = "lora_"
# target -> (its projection's input axes, the weights its adapter's outputs fall on, side by side along its last
# output axis: q's on the query and, with a gate, the gate; qkv's on a Gated DeltaNet layer's q, k and v)
WEIGHTS = {"q": (1, ("wq", "wg")), "k": (1, ("wk",)), "v": (1, ("wv",)), "o": (2, ("wo",)), "gate": (1, ("w_gate",)),
           "up": (1, ("w_up",)), "down": (1, ("w_down",)), "qkv": (1, ("wq", "wk", "wv")), "z": (1, ("wz",)),
           "out": (2, ("wo",))}  # fmt: skip


def split(tree: dict) -> tuple[dict, dict]:
    """(the adapters, the rest), each a tree of the same nesting holding only its own leaves."""
    adapters, base = {}, {}
    for key, value in tree.items():
        if str(key).startswith(PREFIX):
            adapters[key] = value
        elif isinstance(value, dict):
            a, b = split(value)
            if a:
                adapters[key] = a
            if b or not a:
                base[key] = b
        else:
            base[key] = value
    return adapters, base


def join(adapters: dict, base: dict) -> dict:
    """The whole tree again: `split`'s inverse."""
    out = dict(base)
    for key, value in adapters.items():
        nested = isinstance(value, dict) and not str(key).startswith(PREFIX)
        out[key] = join(value, out.get(key, {})) if nested else value
    return out


def switched_off(adapters: dict) -> dict:
    """Adapters that add nothing (B = 0): the base's function, e.g. DPO's reference, with no second copy of
    the weights."""
    return jax.tree.map(jnp.zeros_like, adapters)


def count(tree: dict) -> dict[str, int]:
    """How many adapters each target has in `tree` (targets with none left out)."""
    found: dict[str, int] = {}
    for key, value in tree.items():
        if str(key).startswith(PREFIX):
            target = str(key)[len(PREFIX) :]
            found[target] = found.get(target, 0) + 1
        elif isinstance(value, dict):
            for target, n in count(value).items():
                found[target] = found.get(target, 0) + n
    return found


def fold(tree: dict, scale: float) -> dict:
    """The tree with each adapter merged into its weight (W + scale * A.B) and the adapters gone: the model
    the adapters make, as plain weights (what an export writes)."""
    out = {}
    for key, value in tree.items():
        if str(key).startswith(PREFIX):
            continue
        out[key] = fold(value, scale) if isinstance(value, dict) else value
    for target, (inputs, names) in WEIGHTS.items():
        adapter = tree.get(PREFIX + target)
        if adapter is None:
            continue
        a, b = adapter["a"], adapter["b"]
        lead = a.ndim - 1 - inputs
        outputs = b.shape[lead + 1 :]
        whole = delta(a, b, (*a.shape[:-1], *outputs))
        names = [n for n in names if n in out]
        widths = [math.prod(out[n].shape[lead + inputs :]) // math.prod(outputs[:-1]) for n in names]
        for name, piece in zip(names, jnp.split(whole, np.cumsum(widths)[:-1].tolist(), axis=-1), strict=True):
            out[name] = out[name] + scale * piece.reshape(out[name].shape)
    return out


def delta(a: jax.Array, b: jax.Array, shape: tuple) -> jax.Array:
    """A.B in the weight's `shape`: A (lead..., inputs..., rank), B (lead..., rank, outputs...), where `lead`
    are stacked layers' axes, which the weight has too."""
    lead = a.ndim + b.ndim - 2 - len(shape)
    rank, fan_in = a.shape[-1], math.prod(a.shape[lead:-1])
    a2 = a.reshape(*a.shape[:lead], fan_in, rank).astype(jnp.float32)
    b2 = b.reshape(*b.shape[:lead], rank, -1).astype(jnp.float32)
    return jnp.matmul(a2, b2).reshape(shape)
