"""Context parallelism: each sequence split over the mesh's `context` axis, attention across the pieces.

Every layer but attention treats positions independently, so the sequence can be cut anywhere. For
the causal mask to cost every device the same work, the sequence is cut into 2 x context chunks and
device r holds chunks r and 2 x context - 1 - r (zig-zag): an early chunk with few keys before it
beside a late one with many. The decoder puts its inputs in that order once, before the layers
(`zigzag`), and the loss takes its targets in the same order, so nothing moves back.

Attention then runs under shard_map, each device holding its queries, in one of two ways
(`model.context_attention`):
- all_gather: keys and values gathered from the whole axis, the local queries attending to all of
  them; the backward gathers them again and reduce-scatters their gradients;
- ring: key/value blocks passed round the axis with ppermute, one block a step; the next block is
  sent before this one is computed, so the two can overlap. The backward passes the blocks round
  once more, their gradients travelling with them.
Both are flash attention in XLA: an online softmax over the blocks, TILE keys at a time, and a
custom VJP whose backward recomputes each tile's probabilities from the saved log-sum-exp, so a
device holds its queries x TILE scores per head, whatever the sequence's length. They mask by each
token's place in the original sequence (`_slots`) and by document (segment ids), with grouped-query
heads as in trainer/model/attention.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallelism.rules import LogicalSharding

AXIS = "context"
NEG = float(jnp.finfo(jnp.float32).min)  # a finite "minus infinity": fully masked rows stay free of NaNs
TILE = 512  # keys scored at once: scores per device are its queries x TILE per head, whatever the sequence


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


def gathered(x, seq_len: int, context: int):
    """Inside shard_map: a sequence-split array (keys, values, segment ids) gathered from the whole
    context axis and put back in the sequence's order (None stays None)."""
    if x is None:
        return None
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)[:, np.argsort(zigzag(seq_len, context))]


def positions(seq_len: int, context: int) -> jax.Array:
    """Inside shard_map: the original positions of this device's tokens, in its order."""
    return _slots(jax.lax.axis_index(AXIS), seq_len, context)


def _mask(q_slots, k_slots, q_ids, k_ids, window: int = 0):
    """(batch|1, 1, 1, q, k): causal by original position (within the window, if any), within one document;
    broadcast over groups."""
    distance = q_slots[:, None] - k_slots[None, :]
    mask = ((distance >= 0) & ((distance < window) if window else True))[None]
    if q_ids is not None:
        mask = mask & (q_ids[:, :, None] == k_ids[:, None, :])
    return mask[:, None, None]


def _scores(qg, k, mask):
    """Grouped scores (batch, kv_heads, group, q, k) in fp32, masked to NEG."""
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * qg.shape[-1] ** -0.5
    return jnp.where(mask, scores, NEG)


def _tiles(x, tile: int):
    """(batch, t, ...) -> (t / tile, batch, tile, ...): a block's keys a tile at a time, for lax.scan."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, tile, *x.shape[2:]), 1, 0)


def _untile(x):
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _tile(length: int) -> int:
    return TILE if length % TILE == 0 else length


def _key_tiles(k, v, k_slots, k_ids):
    """A block's keys, values, positions and segment ids, TILE at a time (lax.scan's inputs; zeros for
    absent ids, which the mask then ignores)."""
    tile = _tile(k.shape[1])
    ids = jnp.zeros(k.shape[:2], jnp.int32) if k_ids is None else k_ids
    return _tiles(k, tile), _tiles(v, tile), k_slots.reshape(-1, tile), _tiles(ids, tile)


def _block_forward(qg, q_slots, q_ids, k, v, k_slots, k_ids, state, window: int = 0):
    """The online softmax's (acc, peak, total) after the queries also see one block of keys, TILE keys at a
    time: a device never holds more than its queries x TILE scores per head."""

    def step(state, x):
        acc, peak, total = state
        bk, bv, slots, b_ids = x
        mask = _mask(q_slots, slots, q_ids, None if k_ids is None else b_ids, window)
        scores = _scores(qg, bk, mask)
        new_peak = jnp.maximum(peak, scores.max(-1))
        probs = jnp.where(mask, jnp.exp(scores - new_peak[..., None]), 0.0)
        scale = jnp.exp(peak - new_peak)
        pv = jnp.einsum("bkgts,bskh->bkgth", probs.astype(bv.dtype), bv, preferred_element_type=jnp.float32)
        return (acc * scale[..., None] + pv, new_peak, total * scale + probs.sum(-1)), None

    return jax.lax.scan(step, state, _key_tiles(k, v, k_slots, k_ids))[0]


def _block_backward(qg, dog, lse, delta, q_slots, q_ids, k, v, k_slots, k_ids, window: int = 0):
    """One block's part of (dq, dk, dv), in fp32, recomputing its probabilities from the log-sum-exp."""
    scale = qg.shape[-1] ** -0.5

    def step(dq, x):
        bk, bv, slots, b_ids = x
        mask = _mask(q_slots, slots, q_ids, None if k_ids is None else b_ids, window)
        probs = jnp.where(mask, jnp.exp(_scores(qg, bk, mask) - lse[..., None]), 0.0)
        dv = jnp.einsum("bkgts,btkgh->bskh", probs.astype(dog.dtype), dog, preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("btkgh,bskh->bkgts", dog, bv, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - delta[..., None]) * scale
        dq = dq + jnp.einsum("bkgts,bskh->btkgh", d_scores.astype(bk.dtype), bk, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgts,btkgh->bskh", d_scores.astype(qg.dtype), qg, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), _key_tiles(k, v, k_slots, k_ids))
    return dq, _untile(dk), _untile(dv)


def _first(x, n: int, axis: int = 1):
    return None if x is None else jax.lax.slice_in_dim(x, 0, n, axis=axis)


def _last(x, n: int, axis: int = 1):
    return None if x is None else jax.lax.slice_in_dim(x, x.shape[axis] - n, x.shape[axis], axis=axis)


def _half_block_forward(early, qg, q_slots, q_ids, k, v, k_slots, k_ids, state, window: int = 0):
    """Another device's block, half of it computed. Device r holds chunks (r, 2C-1-r) and the block
    (s, 2C-1-s). If the block is from earlier on the ring (s < r: `early`), all our queries see its
    first chunk and none its second; otherwise only our second chunk sees it, all of it. Either way half
    the block's scores, and the same work on every device."""
    u = qg.shape[1] // 2

    def first_keys(state):
        return _block_forward(qg, q_slots, q_ids, _first(k, u), _first(v, u), k_slots[:u], _first(k_ids, u), state,
                              window)  # fmt: skip

    def last_queries(state):
        kept = tuple(_last(x, u, axis=3) for x in state)
        new = _block_forward(_last(qg, u), q_slots[u:], _last(q_ids, u), k, v, k_slots, k_ids, kept, window)
        return tuple(jnp.concatenate([_first(x, u, axis=3), n], axis=3) for x, n in zip(state, new, strict=True))

    return jax.lax.cond(early, first_keys, last_queries, state)


def _half_block_backward(early, qg, dog, lse, delta, q_slots, q_ids, k, v, k_slots, k_ids, window: int = 0):
    """The gradients of `_half_block_forward`'s half: (dq, dk, dv), zeros where the half was skipped."""
    u = qg.shape[1] // 2

    def first_keys():
        dq, dk, dv = _block_backward(qg, dog, lse, delta, q_slots, q_ids, _first(k, u), _first(v, u), k_slots[:u],
                                     _first(k_ids, u), window)  # fmt: skip
        return dq, *(jnp.concatenate([g, jnp.zeros_like(g)], axis=1) for g in (dk, dv))

    def last_queries():
        dq, dk, dv = _block_backward(_last(qg, u), _last(dog, u), _last(lse, u, 3), _last(delta, u, 3), q_slots[u:],
                                     _last(q_ids, u), k, v, k_slots, k_ids, window)  # fmt: skip
        return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

    return jax.lax.cond(early, first_keys, last_queries)


def _ring_perm(context: int):
    return [(i, (i + 1) % context) for i in range(context)]  # at step s, device r holds block r - s


def _gather(x):
    return None if x is None else jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def _forward(mode, q, k, v, ids, seq_len, context, window):
    """(output, log-sum-exp) of the local queries over the whole sequence's keys."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    r = jax.lax.axis_index(AXIS)
    q_slots = _slots(r, seq_len, context)
    peak = jnp.full((b, kv_heads, n // kv_heads, t), NEG, jnp.float32)
    state = (jnp.zeros((*peak.shape, h), jnp.float32), peak, jnp.zeros_like(peak))
    if mode == "all_gather":
        k_slots = jnp.asarray(zigzag(seq_len, context))
        state = _block_forward(qg, q_slots, ids, _gather(k), _gather(v), k_slots, _gather(ids), state, window)
    else:
        block = (k, v, ids)
        for step in range(context):
            if step < context - 1:  # sent now, used next step: the transfer can overlap this block's compute
                following = jax.lax.ppermute(block, AXIS, _ring_perm(context))
            k_slots = _slots((r - step) % context, seq_len, context)
            if step == 0:  # our own block: causal
                state = _block_forward(qg, q_slots, ids, *block[:2], k_slots, block[2], state, window)
            else:
                state = _half_block_forward(r >= step, qg, q_slots, ids, *block[:2], k_slots, block[2], state, window)
            if step < context - 1:
                block = following
    acc, peak, total = state  # every query sees at least itself, so total > 0
    out = (acc / total[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h).astype(q.dtype)
    return out, peak + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def _attention(mode, q, k, v, ids, seq_len, context, window):
    return _forward(mode, q, k, v, ids, seq_len, context, window)[0]


def _attention_fwd(mode, q, k, v, ids, seq_len, context, window):
    out, lse = _forward(mode, q, k, v, ids, seq_len, context, window)
    return out, (q, k, v, ids, out, lse)


def _attention_bwd(mode, seq_len, context, window, residuals, d_out):
    """Flash attention's backward over the blocks: keys and values gathered again (all_gather, their
    gradients reduce-scattered back), or passed round the ring once more with their gradients."""
    q, k, v, ids, out, lse = residuals
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    dog = d_out.reshape(qg.shape)
    # D = rowsum(dO * O): the softmax's backward term, as in flash attention
    delta = jnp.einsum("btkgh,btkgh->bkgt", dog.astype(jnp.float32), out.reshape(qg.shape).astype(jnp.float32))
    r = jax.lax.axis_index(AXIS)
    q_slots = _slots(r, seq_len, context)
    if mode == "all_gather":
        k_slots = jnp.asarray(zigzag(seq_len, context))
        dq, dk, dv = _block_backward(qg, dog, lse, delta, q_slots, ids, _gather(k), _gather(v), k_slots, _gather(ids),
                                     window)  # fmt: skip
        dk, dv = (jax.lax.psum_scatter(g, AXIS, scatter_dimension=1, tiled=True) for g in (dk, dv))
    else:
        dq = jnp.zeros(qg.shape, jnp.float32)
        block = (k, v, ids, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        for step in range(context):
            bk, bv, b_ids, dk, dv = block
            k_slots = _slots((r - step) % context, seq_len, context)
            inputs = (qg, dog, lse, delta, q_slots, ids, bk, bv, k_slots, b_ids)
            if step == 0:
                dq_part, dk_part, dv_part = _block_backward(*inputs, window)
            else:
                dq_part, dk_part, dv_part = _half_block_backward(r >= step, *inputs, window)
            dq, dk, dv = dq + dq_part, dk + dk_part, dv + dv_part
            # The gradients travel on with their block: after `context` passes they are back with its owner.
            # The block itself is not needed after the last step.
            moving = (bk, bv, b_ids, dk, dv) if step < context - 1 else (dk, dv)
            block = jax.lax.ppermute(moving, AXIS, _ring_perm(context))
        dk, dv = block[-2:]
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)


def over_context(body, q, k, v, segment_ids, shard: LogicalSharding):
    """`body(q, k, v, ids)` on each device's share of a sequence split over the context axis (rows over the
    batch axes, heads over tensor); `ids` is None without segment ids."""
    heads = shard.spec(("batch", "seq", "heads", None))
    kv = shard.spec(("batch", "seq", "kv_heads", None))
    if segment_ids is None:
        mapped = jax.shard_map(lambda q, k, v: body(q, k, v, None), mesh=shard.mesh, in_specs=(heads, kv, kv),
                               out_specs=heads, check_vma=False)  # fmt: skip
        return mapped(q, k, v)
    ids = shard.spec(("batch", "seq"))
    mapped = jax.shard_map(body, mesh=shard.mesh, in_specs=(heads, kv, kv, ids), out_specs=heads, check_vma=False)
    return mapped(q, k, v, segment_ids)


def context_attention(mode: str, q, k, v, segment_ids, shard: LogicalSharding, window: int = 0):
    """Causal attention (over a sliding `window`, if any) over a sequence split (zig-zag) over the context
    axis; q, k, v and the segment ids are global arrays whose sequence axis the rules shard over it. A window
    masks more of each block; the blocks computed are the causal mask's."""
    context, seq_len = ways(shard), q.shape[1]
    body = lambda q, k, v, i: _attention(mode, q, k, v, i, seq_len, context, window)  # noqa: E731
    return over_context(body, q, k, v, segment_ids, shard)
