"""Causal grouped-query attention kernels, chosen by `model.attention`.

All take q (batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim)
and optional segment ids (batch, seq): a query attends to a key only if the key
is not in its future and belongs to the same packed document.

- "xla": the reference, written out in einsums with the softmax in fp32.
- "dot_product": `jax.nn.dot_product_attention`, letting JAX pick the kernel.
- "cudnn": the same call forced onto cuDNN's fused flash kernel (GPUs only).
- "splash": JAX's Pallas splash-attention kernel for TPUs (flash attention
  that skips the blocks the causal and document masks hide); elsewhere it
  runs in Pallas' interpret mode, slowly, which is how it is tested on a CPU.
- "auto": splash on a TPU, cudnn on a GPU, xla on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

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


def splash_block(seq_len: int) -> int:
    """Query and key block: 512 where it divides the sequence (MaxText's default for this kernel; not
    tuned here, there is no TPU to time it on), else 256 or 128, else the whole sequence."""
    return next((b for b in (512, 256, 128) if seq_len % b == 0), seq_len)


@functools.lru_cache(maxsize=32)
def _splash_kernel(seq_len: int, group: int, block: int, interpret: bool):
    """A causal kernel for one key/value head and the `group` query heads that share it (MQA form)."""
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((seq_len, seq_len))] * group)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)  # fmt: skip
    return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q, k, v, segment_ids=None, shard=None, block: int | None = None):
    """The Pallas kernel on each device's shard: a Mosaic kernel cannot be partitioned by XLA, so it
    runs under shard_map, batch split over the batch axes and heads over `tensor`, each device
    holding whole sequences (sequence-parallel layouts are gathered first)."""
    _, t, n, h = q.shape
    kv_heads = k.shape[2]
    mesh = None if shard is None else shard.mesh
    platform = (jax.devices() if mesh is None else mesh.devices.flat)[0].platform
    kernel = _splash_kernel(t, n // kv_heads, block or splash_block(t), platform != "tpu")

    def local(q, k, v, segment_ids):
        rows, local_kv = q.shape[0], k.shape[2]
        # (rows, t, heads, h) -> (rows, kv heads, group, t, h): query heads grouped by their kv head
        qg = (q * h**-0.5).reshape(rows, t, local_kv, -1, h).transpose(0, 2, 3, 1, 4)
        kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def one(q, k, v, ids):
            return kernel(q, k, v, segment_ids=None if ids is None else splash.SegmentIds(ids, ids))

        per_row = jax.vmap(one, in_axes=(0, 0, 0, None))  # over kv heads
        out = jax.vmap(per_row, in_axes=(0, 0, 0, None if segment_ids is None else 0))(qg, kg, vg, segment_ids)
        return out.transpose(0, 3, 1, 2, 4).reshape(rows, t, -1, h).astype(q.dtype)

    if mesh is None:
        return local(q, k, v, segment_ids)
    heads = shard.spec(("batch", None, "heads", None))
    kv = shard.spec(("batch", None, "kv_heads", None))
    if segment_ids is None:
        mapped = jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(heads, kv, kv),
                               out_specs=heads, check_vma=False)  # fmt: skip
        return mapped(q, k, v)
    ids = shard.spec(("batch", None))
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(heads, kv, kv, ids), out_specs=heads, check_vma=False)
    return mapped(q, k, v, segment_ids)


def attend(kind: str, q, k, v, segment_ids=None, shard=None):
    """Dispatch on `model.attention`; config validation has already checked `kind`."""
    mesh = None if shard is None else shard.mesh
    kind = resolve(kind, (jax.devices() if mesh is None else mesh.devices.flat)[0].platform)
    if kind == "xla":
        return xla_attention(q, k, v, segment_ids)
    if kind == "splash":
        return splash_attention(q, k, v, segment_ids, shard)
    return _jax_nn_attention(q, k, v, segment_ids, "cudnn" if kind == "cudnn" else None)
