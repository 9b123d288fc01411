"""Memory per device from arithmetic: what the planner sets beside XLA's compiled figure.

Weights, gradients and optimiser state come from the state's shardings (every
array's shard shape on one device), so FSDP, tensor and stage sharding are
exact. The split follows the mixed-precision textbook (ZeRO's accounting):

- `params`: the weights as the matmuls read them, in the compute dtype
  (bf16: 2 bytes per parameter). Our step casts them a layer at a time, so
  this is an upper bound on what is resident.
- `master_weights`: the fp32 copy the optimiser updates, when compute is not fp32.
- `grads`: fp32 gradients, twice over with gradient accumulation (the running sum).
- `optimizer`: the optimiser's state as stored (AdamW fp32: 8 bytes per parameter).
- `activations`: what the backward pass keeps for one microbatch under the remat
  policy, plus one layer recomputed and the fp32 logits; elements per token
  and layer are counted from the model's shapes below.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trainer.config import microbatch_size


def shard_bytes(tree, itemsize: int | None = None) -> int:
    """Bytes of one device's shards of abstract arrays (at `itemsize` bytes per element if given)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * (itemsize or x.dtype.itemsize) for x in jax.tree.leaves(tree)
    )


def layer_activation_elements(spec, seq_len: int, tensor: int, act_bytes: int, platform: str) -> dict[str, float]:
    """Elements per token one layer keeps for the backward pass, under each remat policy.

    Head and MLP-width tensors are split over `tensor`; the residual-width ones
    are not. Where attention materialises its scores (on `platform`, see
    materialises_scores) three fp32 arrays of heads x seq per token are kept (the
    scores, the masked scores and the softmax: what XLA's compiler was seen to
    keep), counted in compute-dtype elements of `act_bytes`; fused kernels keep
    only their output and statistics.
    """
    a = spec.arch
    d, f = a.d_model, a.d_ff / tensor
    q, kv = a.n_heads * a.head_dim / tensor, a.n_kv_heads * a.head_dim / tensor
    scores = 3 * (4 / act_bytes) * a.n_heads * seq_len / tensor if materialises_scores(spec, platform) else 0
    projections = q + 2 * kv + d + 2 * f + d  # q, k, v; attention out projection; gate, up; down
    everything = (
        4 * d  # layer input, two norm outputs, the residual after attention
        + projections
        + q + kv  # rotated queries and keys
        + scores
        + q  # attention output before its projection
        + 2 * f  # silu(gate) and the gated product
    )  # fmt: skip
    return {
        "none": everything,
        "full": d,
        "save_dots_no_batch": d + projections,
        "save_dots": d + projections + scores / 3 + q,  # + the fp32 scores and the attention output
        # The layer being recomputed under remat: its backward follows at once, and XLA:TPU holds one
        # fp32 score array of it at a time (llm_1b, dot_product, full remat on v5e-4 / v5p-8: with three
        # the arithmetic read 24.3 GiB against XLA's 16.7 / 17.2; with one, 16.3).
        "recomputed": everything - scores * 2 / 3,
    }


def materialises_scores(spec, platform: str) -> bool:
    """Whether attention writes its (heads, seq, seq) scores to memory: XLA's attention does, and so does
    `dot_product` wherever JAX has no fused kernel for it (it picks cuDNN's on a GPU only)."""
    kind = spec.execution.attention
    return kind == "xla" or (kind == "dot_product" and platform not in ("gpu", "cuda", "rocm"))


def activation_bytes(cfg, spec, mesh_shape: dict[str, int], platform: str) -> int:
    """Bytes one device keeps for the backward pass of one microbatch."""
    t = cfg.train
    rows = microbatch_size(cfg) / (mesh_shape["data"] * mesh_shape["fsdp"])
    tokens, tensor = rows * cfg.data.seq_len, mesh_shape["tensor"]
    act = jnp.dtype(cfg.precision.compute_dtype).itemsize
    per_layer = layer_activation_elements(spec, cfg.data.seq_len, tensor, act, platform)
    layers_here = spec.arch.n_layers // mesh_shape["stage"]
    kept = layers_here * per_layer[spec.execution.remat]
    if spec.execution.remat != "none":
        kept += per_layer["recomputed"]
    if mesh_shape["stage"] > 1:
        # GPipe holds every microbatch's activations until its backward starts.
        m = t.pipeline_microbatches
        kept *= (m + mesh_shape["stage"] - 1) / m
    # fp32 logits and their gradient: for every position, or one loss chunk's at a time.
    chunk = spec.execution.loss_chunk
    logit_positions = rows * chunk if chunk else tokens
    return int(tokens * kept * act + logit_positions * 2 * 4 * spec.arch.vocab_size / tensor)


def state_bytes(setup) -> dict[str, int]:
    """Bytes of the parameters (as stored, fp32) and the optimiser state on one device, from the shardings."""
    state = setup.abstract_state()
    return {"params": shard_bytes(state.params), "optimizer": shard_bytes(state.opt_state)}


def bytes_per_device(cfg, setup, spec=None, state: dict[str, int] | None = None) -> dict[str, int]:
    """The analytic breakdown, per device, with its total. `spec` and `state` (from state_bytes) let a
    search vary remat, loss chunk and accumulation over one built setup."""
    spec, state = spec or setup.spec, state or state_bytes(setup)
    compute = jnp.dtype(cfg.precision.compute_dtype).itemsize
    fp32 = state["params"]  # the stored parameters are fp32
    out = {
        "params": fp32 * compute // 4,
        "master_weights": fp32 if compute != 4 else 0,
        "grads": fp32 * (2 if cfg.train.grad_accum_steps > 1 else 1),
        "optimizer": state["optimizer"],
        "activations": activation_bytes(cfg, spec, dict(setup.mesh.shape), setup.mesh.devices.flat[0].platform),
    }
    out["total"] = sum(out.values())
    return out
