"""Context parallelism: each sequence split over the mesh's `context` axis, attention across the pieces.

Every layer but attention treats positions independently, so the sequence can be cut anywhere. For
the causal mask to cost every device the same work, the sequence is cut into 2 x context chunks and
device r holds chunks r and 2 x context - 1 - r (zig-zag): an early chunk with few keys before it
beside a late one with many. The decoder puts its inputs in that order once, before the layers
(`zigzag`), and the loss takes its targets in the same order, so nothing moves back.

Attention then runs under shard_map, each device holding its queries, in one of two ways
(`model.context_attention`):
- all_gather: keys and values gathered from the whole axis, the local queries attending to all of
  them (scores per device: seq / context x seq);
- ring: key/value blocks passed round the axis with ppermute, context steps of (seq / context)^2
  scores merged by an online softmax; the next block is sent before this one is computed, so the
  two can overlap. Its backward (a custom VJP, as flash attention's) recomputes each block from the
  saved log-sum-exp, the key/value gradients travelling round the ring with their blocks.
Both mask by each token's place in the original sequence (`slots`) and by document (segment ids),
with grouped-query heads as in trainer/model/attention.py, each block computed in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallelism.rules import LogicalSharding

AXIS = "context"
NEG = float(jnp.finfo(jnp.float32).min)  # a finite "minus infinity": fully masked rows stay free of NaNs


def ways(shard: LogicalSharding) -> int:
    """How many pieces the rules cut the sequence into over the context axis (1: none)."""
    if shard.mesh is None or AXIS not in dict(shard.rules).get("seq", ()):
        return 1
    return shard.mesh.shape[AXIS]


def zigzag(seq_len: int, context: int) -> np.ndarray:
    """The layers' order of the sequence's positions: device r's contiguous share holds chunks r and
    2 x context - 1 - r."""
    chunks = np.arange(seq_len).reshape(2 * context, -1)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]]) for r in range(context)])


def _slots(device, seq_len: int, context: int) -> jax.Array:
    """The original positions of the tokens `device` (a traced axis index) holds, in its order."""
    chunk = seq_len // (2 * context)
    steps = jnp.arange(chunk)
    return jnp.concatenate([device * chunk + steps, (2 * context - 1 - device) * chunk + steps])


def _mask(q_slots, k_slots, q_ids, k_ids):
    """(batch|1, 1, 1, q, k): causal by original position, within one document; broadcast over groups."""
    mask = (k_slots[None, :] <= q_slots[:, None])[None]
    if q_ids is not None:
        mask = mask & (q_ids[:, :, None] == k_ids[:, None, :])
    return mask[:, None, None]


def _scores(qg, k, mask):
    """Grouped scores (batch, kv_heads, group, q, k) in fp32, masked to NEG."""
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * qg.shape[-1] ** -0.5
    return jnp.where(mask, scores, NEG)


def _all_gather(q, k, v, ids, seq_len: int, context: int):
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    k_all, v_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (k, v))
    ids_all = None if ids is None else jax.lax.all_gather(ids, AXIS, axis=1, tiled=True)
    q_slots = _slots(jax.lax.axis_index(AXIS), seq_len, context)
    mask = _mask(q_slots, jnp.asarray(zigzag(seq_len, context)), ids, ids_all)
    probs = jax.nn.softmax(_scores(q.reshape(b, t, kv_heads, n // kv_heads, h), k_all, mask), axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v_all)
    return out.reshape(b, t, n, h)


def _ring_perm(context: int):
    return [(i, (i + 1) % context) for i in range(context)]  # at step s, device r holds block r - s


def _ring_forward(q, k, v, ids, seq_len, context):
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    r = jax.lax.axis_index(AXIS)
    q_slots = _slots(r, seq_len, context)
    peak = jnp.full((b, kv_heads, n // kv_heads, t), NEG, jnp.float32)
    total = jnp.zeros_like(peak)
    acc = jnp.zeros((b, kv_heads, n // kv_heads, t, h), jnp.float32)
    block = (k, v, ids)
    for step in range(context):
        if step < context - 1:  # sent now, used next step: the transfer can overlap this block's compute
            following = jax.lax.ppermute(block, AXIS, _ring_perm(context))
        bk, bv, b_ids = block
        mask = _mask(q_slots, _slots((r - step) % context, seq_len, context), ids, b_ids)
        scores = _scores(qg, bk, mask)
        new_peak = jnp.maximum(peak, scores.max(-1))
        probs = jnp.where(mask, jnp.exp(scores - new_peak[..., None]), 0.0)
        scale = jnp.exp(peak - new_peak)
        total = total * scale + probs.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgts,bskh->bkgth", probs.astype(v.dtype), bv,
                                                  preferred_element_type=jnp.float32)  # fmt: skip
        peak = new_peak
        if step < context - 1:
            block = following
    out = acc / total[..., None]  # every query sees at least itself, so total > 0
    lse = peak + jnp.log(total)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, ids, seq_len, context):
    return _ring_forward(q, k, v, ids, seq_len, context)[0]


def _ring_fwd(q, k, v, ids, seq_len, context):
    out, lse = _ring_forward(q, k, v, ids, seq_len, context)
    return out, (q, k, v, ids, out, lse)


def _ring_bwd(seq_len, context, residuals, d_out):
    q, k, v, ids, out, lse = residuals
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    group = n // kv_heads
    qg = q.reshape(b, t, kv_heads, group, h)
    dog = d_out.reshape(b, t, kv_heads, group, h)
    # D = rowsum(dO * O): the softmax's backward term, as in flash attention
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog.astype(jnp.float32), out.reshape(qg.shape).astype(jnp.float32))
    r = jax.lax.axis_index(AXIS)
    q_slots = _slots(r, seq_len, context)
    dq = jnp.zeros(qg.shape, jnp.float32)
    block = (k, v, ids, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(context):
        bk, bv, b_ids, dk, dv = block
        mask = _mask(q_slots, _slots((r - step) % context, seq_len, context), ids, b_ids)
        probs = jnp.where(mask, jnp.exp(_scores(qg, bk, mask) - lse[..., None]), 0.0)
        dv = dv + jnp.einsum("bkgts,btkgh->bskh", probs.astype(d_out.dtype), dog, preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("btkgh,bskh->bkgts", dog, bv, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - delta[..., None]) * h**-0.5
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", d_scores.astype(bk.dtype), bk, preferred_element_type=jnp.float32)
        dk = dk + jnp.einsum("bkgts,btkgh->bskh", d_scores.astype(q.dtype), qg, preferred_element_type=jnp.float32)
        # After `context` passes every block and its gradients are back with their owner.
        block = jax.lax.ppermute((bk, bv, b_ids, dk, dv), AXIS, _ring_perm(context))
    _, _, _, dk, dv = block
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)


def context_attention(mode: str, q, k, v, segment_ids, shard: LogicalSharding):
    """Causal attention over a sequence split (zig-zag) over the context axis; q, k, v and the segment
    ids are global arrays whose sequence axis the rules shard over it."""
    context, seq_len = ways(shard), q.shape[1]
    heads = shard.spec(("batch", "seq", "heads", None))
    kv = shard.spec(("batch", "seq", "kv_heads", None))
    ids = shard.spec(("batch", "seq"))
    local = {"ring": _ring, "all_gather": _all_gather}[mode]
    if segment_ids is None:
        body = lambda q, k, v: local(q, k, v, None, seq_len, context)  # noqa: E731
        return jax.shard_map(body, mesh=shard.mesh, in_specs=(heads, kv, kv), out_specs=heads, check_vma=False)(
            q, k, v
        )
    body = lambda q, k, v, i: local(q, k, v, i, seq_len, context)  # noqa: E731
    return jax.shard_map(body, mesh=shard.mesh, in_specs=(heads, kv, kv, ids), out_specs=heads, check_vma=False)(
        q, k, v, segment_ids
    )
