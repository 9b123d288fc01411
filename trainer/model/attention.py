"""Causal grouped-query attention kernels, chosen by `model.attention`.

All take q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim)
and optional segment ids (batch, seq): a query attends to a key only if the key
is not in its future and belongs to the same packed document; with a `window` (a
local layer's model.sliding_window), only if it is also one of the window - 1 keys
before the query or the query's own.

- "xla": the reference, written out in einsums with the softmax in fp32.
- "dot_product": `jax.nn.dot_product_attention`, letting JAX pick the kernel.
- "cudnn": the same call forced onto cuDNN's fused flash kernel (GPUs only).
- "splash": JAX's Pallas splash-attention kernel for TPUs (flash attention
  that skips the blocks the causal mask hides; trainer/model/splash.py); elsewhere
  it runs in Pallas' interpret mode, slowly, which is how it is tested on a CPU.
- "auto": splash on a TPU, cudnn on a GPU, xla on a CPU.

With the sequence split over the mesh's context axis, attention crosses the devices as
`model.context_attention` says: ring or all_gather in XLA, block by block (trainer/model/context.py),
or, for all_gather with splash or cudnn, the fused kernel over the gathered keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.model.context import context_attention, gathered, over_context, positions, ways
from trainer.model.splash import splash_attention

AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "cudnn"}


def attention_mask(segment_ids: jax.Array | None, q_len: int, kv_len: int, window: int = 0) -> jax.Array:
    """Boolean (batch|1, 1, q, kv) mask: causal (within the window, if any), and within one segment if ids
    are given."""
    causal = jnp.tril(jnp.ones((q_len, kv_len), bool), k=kv_len - q_len)
    if window:
        causal = causal & ~jnp.tril(jnp.ones((q_len, kv_len), bool), k=kv_len - q_len - window)
    causal = causal[None, None]
    if segment_ids is None:
        return causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal & same


def masked_attention(q, k, v, mask, sinks=None):
    """Softmax attention under an explicit boolean mask (batch|1, 1, q, kv), fp32 softmax. `sinks` (heads,):
    each head's learned logit of a key with no value (gpt-oss's attention sinks), which takes a share of
    the softmax and so lets a query attend to nothing."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    # Group the query heads that share one key/value head instead of repeating k and v.
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)  # mask broadcast over the group
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, -1, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, v.shape[-1])  # values may be narrower than queries (latent attention's decode)


def xla_attention(q, k, v, segment_ids=None, window: int = 0, sinks=None):
    t = q.shape[1]
    if window and t == k.shape[1] and t % window == 0 and t >= 2 * window:
        return local_attention(q, k, v, segment_ids, window, sinks)
    return masked_attention(q, k, v, attention_mask(segment_ids, t, k.shape[1], window), sinks)


def local_attention(q, k, v, segment_ids, window: int, sinks=None):
    """A local layer's attention in chunks of `window` queries, each over its own chunk's keys and the
    chunk's before (all a window can reach): scores of seq x 2 window per head instead of seq x seq (at 8192
    tokens and a window of 512, an eighth)."""
    b, t, n, h = q.shape
    chunks = t // window

    def pairs(x):  # (b, t, ...) -> (b * chunks, 2 window, ...): each chunk after the one before it (zeros first)
        x = x.reshape(b, chunks, window, *x.shape[2:])
        before = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        return jnp.concatenate([before, x], axis=2).reshape(b * chunks, 2 * window, *x.shape[3:])

    # query i of a chunk sees key s of its pair if 0 <= i + window - s < window, and not the zeros before the first
    distance = jnp.arange(window)[:, None] + window - jnp.arange(2 * window)[None, :]
    mask = jnp.broadcast_to((distance >= 0) & (distance < window), (chunks, window, 2 * window))
    mask = mask & ((jnp.arange(chunks)[:, None, None] > 0) | (jnp.arange(2 * window) >= window))
    mask = jnp.broadcast_to(mask[None], (b, chunks, window, 2 * window))
    if segment_ids is not None:
        q_ids = segment_ids.reshape(b, chunks, window)
        mask = mask & (q_ids[..., :, None] == pairs(segment_ids).reshape(b, chunks, 1, 2 * window))
    out = masked_attention(q.reshape(b * chunks, window, n, h), pairs(k), pairs(v),
                           mask.reshape(b * chunks, 1, window, 2 * window), sinks)  # fmt: skip
    return out.reshape(b, t, n, v.shape[-1])


def cached_attention(q, k_cache, v_cache, q_positions, sinks=None):
    """Decoding: queries at absolute `q_positions` (batch, q) over a cache whose slot s holds position s.

    Slots past a query's position are empty or in its future; the mask hides both.
    """
    slots = jnp.arange(k_cache.shape[1])
    mask = slots[None, None, None, :] <= q_positions[:, None, :, None]
    return masked_attention(q, k_cache, v_cache, mask, sinks)


def ring_attention(q, k, v, k_ring, v_ring, ring_positions, q_positions, window: int, sinks=None):
    """Decoding a local layer: its cache is a ring of `window` slots (fewer if the whole decode is shorter),
    slot s holding the keys and values of position `ring_positions[:, s]` (-1: empty), the newest positions
    written (at position mod slots). Queries at `q_positions` (batch, q) (-1: padding, which is never
    written) attend over the ring and this call's own keys within the window, then the newest of those keys
    take their slots. Returns (output, new ring)."""
    keys, values = (
        jnp.concatenate([k_ring, k.astype(k_ring.dtype)], 1),
        jnp.concatenate([v_ring, v.astype(v_ring.dtype)], 1),
    )
    key_positions = jnp.concatenate([ring_positions, q_positions], 1)
    kp, qp = key_positions[:, None, None, :], q_positions[:, None, :, None]
    out = masked_attention(q, keys, values, (kp >= 0) & (kp <= qp) & (qp - kp < window), sinks)
    # A prompt longer than the ring writes only its last tokens: no two writes share a slot.
    size = k_ring.shape[1]
    newest = q_positions > q_positions.max(axis=1, keepdims=True) - size
    slots = jnp.where((q_positions >= 0) & newest, q_positions % size, size)  # slot `size`: dropped
    rows = jnp.arange(q.shape[0])[:, None]
    k_ring = k_ring.at[rows, slots].set(k.astype(k_ring.dtype), mode="drop")
    v_ring = v_ring.at[rows, slots].set(v.astype(v_ring.dtype), mode="drop")
    return out, (k_ring, v_ring, ring_positions.at[rows, slots].set(q_positions, mode="drop"))


def _jax_nn_attention(q, k, v, segment_ids, implementation, window: int = 0):
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation,
                                        local_window_size=(window - 1, 0) if window else None)  # fmt: skip


def resolve(kind: str, platform: str) -> str:
    """The kernel `model.attention` names on devices of `platform` ('auto' picks by platform)."""
    return AUTO.get(platform, "xla") if kind == "auto" else kind


def context_kernel(kind: str, mode: str, platform: str) -> str:
    """What computes attention over the context axis: with `model.context_attention=all_gather`, the fused
    kernel `model.attention` resolves to (splash, cudnn) over the gathered keys; otherwise flash attention
    in XLA, block by block (trainer/model/context.py)."""
    fused = resolve(kind, platform)
    return fused if mode == "all_gather" and fused in ("splash", "cudnn") else "xla"


def gathered_attention(q, k, v, segment_ids, shard, implementation: str | None = "cudnn", window: int = 0):
    """all_gather through `jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU): each device's
    queries, in zig-zag order, over the keys and values gathered from the context axis in the sequence's
    order, under the mask their original positions and documents give. The mask is an explicit
    (rows, 1, queries, keys) array: cuDNN takes it as a bias, so it costs queries x keys per row."""
    seq_len, context = q.shape[1], ways(shard)
    body = lambda q, k, v, i: gathered_local(q, k, v, i, seq_len, context, implementation, window)  # noqa: E731
    return over_context(body, q, k, v, segment_ids, shard)


def gathered_local(q, k, v, ids, seq_len: int, context: int, implementation: str | None, window: int = 0):
    """One device's part of `gathered_attention`, under an axis named context (shard_map's, or vmap's)."""
    distance = positions(seq_len, context)[:, None] - jnp.arange(seq_len)[None, :]
    mask = ((distance >= 0) & ((distance < window) if window else True))[None, None]
    if ids is not None:
        mask = mask & (ids[:, None, :, None] == gathered(ids, seq_len, context)[:, None, None, :])
    k, v = gathered(k, seq_len, context), gathered(v, seq_len, context)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def attend(kind: str, q, k, v, segment_ids=None, shard=None, context_mode: str = "ring", window: int = 0,
           sinks=None):  # fmt: skip
    """Dispatch on `model.attention` (and `model.context_attention` when the sequence is split over the
    context axis); config validation has already checked both. `window`: a local layer's (0: global);
    `sinks`: attention sinks' logits (heads,), which xla and splash take (setup refuses the others)."""
    mesh = None if shard is None else shard.mesh
    platform = (jax.devices() if mesh is None else mesh.devices.flat)[0].platform
    if shard is not None and ways(shard) > 1:
        kernel = context_kernel(kind, context_mode, platform)
        if kernel == "splash":
            return splash_attention(q, k, v, segment_ids, shard, window=window)
        if kernel == "cudnn":
            return gathered_attention(q, k, v, segment_ids, shard, window=window)
        return context_attention(context_mode, q, k, v, segment_ids, shard, window)
    kind = resolve(kind, platform)
    if kind == "xla":
        return xla_attention(q, k, v, segment_ids, window, sinks)
    if kind == "splash":
        return splash_attention(q, k, v, segment_ids, shard, window=window, sinks=sinks)
    return _jax_nn_attention(q, k, v, segment_ids, "cudnn" if kind == "cudnn" else None, window)
