"""Causal grouped-query attention kernels, chosen by `model.attention`.

All take q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim)
and optional segment ids (batch, seq): a query attends to a key only if the key
is not in its future and belongs to the same packed document.

- "xla": the reference, written out in einsums with the softmax in fp32.
- "dot_product": `jax.nn.dot_product_attention`, letting JAX pick the kernel.
- "cudnn": the same call forced onto cuDNN's fused flash kernel (GPUs only).
- "splash": JAX's Pallas splash-attention kernel for TPUs (flash attention
  that skips the blocks the causal mask hides; trainer/model/splash.py); elsewhere
  it runs in Pallas' interpret mode, slowly, which is how it is tested on a CPU.
- "auto": splash on a TPU, cudnn on a GPU, xla on a CPU.

With the sequence split over the mesh's context axis, attention crosses the devices as
`model.context_attention` says (trainer/model/context.py), each block in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.model.context import context_attention, ways
from trainer.model.splash import splash_attention

AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "cudnn"}


def attention_mask(segment_ids: jax.Array | None, q_len: int, kv_len: int) -> jax.Array:
    """Boolean (batch|1, 1, q, kv) mask: causal, and within one segment if ids are given."""
    causal = jnp.tril(jnp.ones((q_len, kv_len), bool), k=kv_len - q_len)[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def masked_attention(q, k, v, mask):
    """Softmax attention under an explicit boolean mask (batch|1, 1, q, kv), fp32 softmax."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    # Group the query heads that share one key/value head instead of repeating k and v.
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)  # mask broadcast over the group
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


def xla_attention(q, k, v, segment_ids=None):
    return masked_attention(q, k, v, attention_mask(segment_ids, q.shape[1], k.shape[1]))


def cached_attention(q, k_cache, v_cache, q_positions):
    """Decoding: queries at absolute `q_positions` (batch, q) over a cache whose slot s holds position s.

    Slots past a query's position are empty or in its future; the mask hides both.
    """
    slots = jnp.arange(k_cache.shape[1])
    mask = slots[None, None, None, :] <= q_positions[:, None, :, None]
    return masked_attention(q, k_cache, v_cache, mask)


def _jax_nn_attention(q, k, v, segment_ids, implementation):
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def resolve(kind: str, platform: str) -> str:
    """The kernel `model.attention` names on devices of `platform` ('auto' picks by platform)."""
    return AUTO.get(platform, "xla") if kind == "auto" else kind


def attend(kind: str, q, k, v, segment_ids=None, shard=None, context_mode: str = "ring"):
    """Dispatch on `model.attention` (and `model.context_attention` when the sequence is split over the
    context axis); config validation has already checked both."""
    if shard is not None and ways(shard) > 1:
        return context_attention(context_mode, q, k, v, segment_ids, shard)
    mesh = None if shard is None else shard.mesh
    kind = resolve(kind, (jax.devices() if mesh is None else mesh.devices.flat)[0].platform)
    if kind == "xla":
        return xla_attention(q, k, v, segment_ids)
    if kind == "splash":
        return splash_attention(q, k, v, segment_ids, shard)
    return _jax_nn_attention(q, k, v, segment_ids, "cudnn" if kind == "cudnn" else None)
