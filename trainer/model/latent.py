"""Multi-head latent attention (DeepSeek-V2/V3), in place of grouped-query attention when model.mla.kv_rank > 0.

Keys and values come from a latent c = RMSNorm(x W_kv_a), kv_rank wide: each head's key is
[c W_uk, the shared RoPE part], its value c W_uv (W_kv_b = [W_uk, W_uv]); the query's RoPE part is its
own per head, and the query comes from a q_rank-wide latent with its norm (or from x directly with
q_rank 0). RoPE rotates only the rope_dim parts, so the position lives in a key part that every head
shares and the latent stays position-free.

Training expands the latent into per-head keys and values and runs any of the attention kernels (values
padded to the query's width where it differs, for the fused kernels). Decoding caches only the latent and
the roped shared key part, (kv_rank + rope_dim) numbers a token and layer, and attends in the latent space:
W_uk is absorbed into the query (q_nope W_uk^T is kv_rank wide) and W_uv applied after the softmax, so
the cached latents are never expanded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.model.attention import attend, masked_attention
from trainer.model.low_precision import einsum
from trainer.model.primitives import RMSNorm, apply_rope, param
from trainer.model.spec import ModelSpec


class LatentAttention(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):

        a, m = spec.arch, spec.arch.mla
        d, n = a.d_model, a.n_heads
        std = spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5
        qk = m.nope_dim + m.rope_dim
        if m.q_rank:
            self.wq_a = param(rngs, (d, m.q_rank), ("embed", "q_latent"), std)
            self.q_latent_norm = RMSNorm(m.q_rank, a.norm_eps, "q_latent")
            self.wq_b = param(rngs, (m.q_rank, n, qk), ("q_latent", "heads", "head_dim"), std)
        else:
            self.wq = param(rngs, (d, n, qk), ("embed", "heads", "head_dim"), std)
        self.wkv_a = param(rngs, (d, m.kv_rank), ("embed", "kv_latent"), std)
        self.kv_latent_norm = RMSNorm(m.kv_rank, a.norm_eps, "kv_latent")
        self.wk_rope = param(rngs, (d, m.rope_dim), ("embed", "head_dim"), std)
        self.wkv_b = param(rngs, (m.kv_rank, n, m.nope_dim + m.v_dim), ("kv_latent", "heads", "head_dim"), std)
        self.wo = param(rngs, (n, m.v_dim, d), ("heads", "head_dim", "embed"), out_std)
        self.dims = (m.nope_dim, m.rope_dim, m.v_dim)
        self.softmax_factor = a.rope_scaling.softmax_factor
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x, tables, segment_ids, cache=None, key=None):
        """As layers.Attention: `tables` {"global": RoPE tables of rope_dim}; with `cache` = (latents,
        rope keys, positions), writes this call's at `positions` and attends over the cache. `key` is unused:
        latent attention takes no adapters."""

        dt = self.execution.compute_dtype
        nope, rope, v_dim = self.dims
        tables = tables["global"]
        if hasattr(self, "wq_a"):
            q_latent = self.q_latent_norm(self._project("btd,dr->btr", x, self.wq_a))
            q = self._project("btr,rnh->btnh", q_latent, self.wq_b)
        else:
            q = self._project("btd,dnh->btnh", x, self.wq)
        if self.softmax_factor != 1:  # DeepSeek's YaRN: the softmax's scale times m(mscale_all_dim)^2
            q = q * jnp.asarray(self.softmax_factor, q.dtype)
        q_nope, q_rope = q[..., :nope], apply_rope(q[..., nope:], tables)
        latent = self.kv_latent_norm(self._project("btd,dr->btr", x, self.wkv_a))  # (b, t, kv_rank)
        k_rope = apply_rope(self._project("btd,dh->bth", x, self.wk_rope)[:, :, None, :], tables)  # (b, t, 1, rope)
        w_kv = self.wkv_b[...].astype(dt)
        if cache is None:
            return self._expanded(q_nope, q_rope, latent, k_rope, w_kv, segment_ids), None
        latents, rope_keys, positions = cache
        write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new, at, axis=0))
        latents = write(latents, latent.astype(latents.dtype), positions[:, 0])  # -1: at the end (layers.py)
        rope_keys = write(rope_keys, k_rope[:, :, 0].astype(rope_keys.dtype), positions[:, 0])
        # Absorbed: scores q_nope . (c W_uk) = (q_nope W_uk^T) . c, and the output (p c) W_uv.
        q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, w_kv[..., :nope])
        width = latents.shape[-1] + rope
        # masked_attention scales by its query's width^-0.5; the model's scale is (nope + rope)^-0.5
        q_all = jnp.concatenate([q_latent, q_rope], -1) * jnp.asarray((width / (nope + rope)) ** 0.5, q.dtype)
        keys = jnp.concatenate([latents, rope_keys], -1)[:, :, None, :].astype(q.dtype)
        mask = jnp.arange(latents.shape[1])[None, None, None, :] <= positions[:, None, :, None]
        out_latent = masked_attention(q_all, keys, latents[:, :, None, :].astype(q.dtype), mask)
        out = jnp.einsum("btnr,rnv->btnv", out_latent, w_kv[..., nope:])
        return self._project("btnv,nvd->btd", out, self.wo), (latents, rope_keys)

    def _expanded(self, q_nope, q_rope, latent, k_rope, w_kv, segment_ids):
        """Training's attention: per-head keys and values from the latent, through `model.attention`."""
        nope, rope, v_dim = self.dims
        kv = einsum("btr,rnh->btnh", latent, w_kv, self.execution, "attention")
        heads = kv.shape[2]
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, (*k_rope.shape[:2], heads, rope))], -1)
        q, v = jnp.concatenate([q_nope, q_rope], -1), kv[..., nope:]
        if v_dim < nope + rope:  # the fused kernels take one head width: values padded, the padding's output cut
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, nope + rope - v_dim)))
        names = ("batch", "seq", "heads", "head_dim")
        q, k, v = (self.shard.constrain(a, names) for a in (q, k, v))
        run = self.execution
        out = attend(run.attention, q, k, v, segment_ids, self.shard, run.context_attention)[..., :v_dim]
        return self._project("btnv,nvd->btd", out, self.wo)

    def _project(self, subscripts: str, x: jax.Array, w) -> jax.Array:
        """x times the weight `w` in the compute dtype, quantised where model.quant names attention."""
        return einsum(subscripts, x, w[...].astype(self.execution.compute_dtype), self.execution, "attention")
