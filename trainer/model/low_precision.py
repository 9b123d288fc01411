"""Quantised training's matmuls (model.quant): projections computed in int8 or fp8, forward and backward.

`model.quant.matmul` names the kind and `model.quant.targets` the matmuls: `attention` (the query, key,
value and output projections, latent attention's included), `mlp` (gate, up, down), `experts` (their gate,
up and down under model.moe.impl=capacity) and `logits` (the output head; left out by default, as the
stacks we compare with leave it: its error lands on every token's loss directly).

Each named matmul runs through Qwix's quantised-training dot_general (`dot_general_qt`, the function
Qwix's QtProvider applies when it intercepts a model's einsums; we call it where our model multiplies, so
no interception and no change to the model's parameters or their logical sharding):

    int8  forward: activations and weights int8, scaled by absmax per channel (each token's row of the
          activations, each output channel of the weights), products summed in int32 and rescaled;
          backward: the incoming gradient int8 likewise (per channel of its non-contracted axes), times
          the forward's int8 operands (their scales moved onto the gradient), summed in int32.
    fp8   the same with e4m3 operands forward and e5m2 gradients backward (the usual split: e4m3's
          precision for values, e5m2's range for gradients), summed in the compute dtype.

The weights stay the fp32 master copy in the state (quantised afresh each step from it, so the optimiser,
checkpoints and exports never see a quantised array), and attention's scores and values, norms, the
router and the loss stay in the compute dtype. On a CPU XLA runs these dots as they are written (int8
with int32 sums; fp8 converted to a wider float first), so the arithmetic, not the speed, is what a CPU
shows: the TPU compiler lowers int8 dots to the MXU's int8 mode (scripts/plan.py --target shows the s8
dots in its HLO).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt

# Forward operands' type, gradients' type.
KINDS = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
TARGETS = ("attention", "mlp", "experts", "logits")


@functools.cache
def _dot_general(kind: str):
    """jax.lax.dot_general's signature over Qwix's dot_general_qt: one function per kind, so jnp.einsum's
    trace cache (it takes the function as a static argument) sees the same one every time."""
    forward, backward = KINDS[kind]
    config = DotGeneralQtConfig(lhs_qtype=forward, rhs_qtype=forward, dlhs_grad_qtype=backward,
                                drhs_grad_qtype=backward)  # fmt: skip

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        out = dot_general_qt(lhs, rhs, dimension_numbers, config)
        return out if preferred_element_type is None else out.astype(preferred_element_type)

    return dot_general


def einsum(subscripts: str, x: jax.Array, w: jax.Array, execution, target: str, **kwargs) -> jax.Array:
    """jnp.einsum of an activation `x` and a weight `w`, quantised where model.quant asks it of `target`
    (`execution`: the model's Execution, or None: never)."""
    if execution is not None and execution.quant_matmul and target in execution.quant_targets:
        return jnp.einsum(subscripts, x, w, _dot_general=_dot_general(execution.quant_matmul), **kwargs)
    return jnp.einsum(subscripts, x, w, **kwargs)
