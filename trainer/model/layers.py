"""The decoder's layers: grouped-query attention and a block (attention, then an MLP or experts), built from
trainer/model/primitives.py's parts.

A local layer (model.sliding_window) attends over its window, with its own RoPE tables where the family
has a local base (Gemma 3); in decoding its cache is a ring of `window` slots.

Every parameter is created with its logical axis names (trainer/model/spec.py
reads them; parallelism/rules.py maps them to mesh axes). Parameters stay in
fp32; each matmul runs in the execution's compute dtype, while norms, the
attention softmax and the logits are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.model import quantised
from trainer.model.attention import attend, cached_attention, ring_attention
from trainer.model.delta import GatedDeltaNet
from trainer.model.latent import LatentAttention
from trainer.model.low_precision import einsum
from trainer.model.moe import MoE
from trainer.model.primitives import MLP, Adapter, RMSNorm, adapted, apply_rope, param, update
from trainer.model.quantised import weight
from trainer.model.spec import ModelSpec

RESIDUAL = ("batch", "residual_seq", "embed")  # the residual stream between blocks


class Attention(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs, local: bool = False):
        a = spec.arch
        d, n, k, h = a.d_model, a.n_heads, a.n_kv_heads, a.head_dim
        std = spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5  # keeps the residual stream's growth depth-independent
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std)
        self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std)
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), out_std)
        if a.attention_gate:  # Qwen3.5's: each head's output times sigmoid(x . wg), wg given beside wq
            self.wg = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std)
        # With a gate, q's adapter is q_proj's: each head's query, then its gate (2h wide).
        q_width = 2 * h if a.attention_gate else h
        for name, inputs, outputs in (("q", ((d,), ("embed",)), ((n, q_width), ("heads", "head_dim"))),
                                      ("k", ((d,), ("embed",)), ((k, h), ("kv_heads", "head_dim"))),
                                      ("v", ((d,), ("embed",)), ((k, h), ("kv_heads", "head_dim"))),
                                      ("o", ((n, h), ("heads", "head_dim")), ((d,), ("embed",)))):  # fmt: skip
            if a.lora.on(name):
                setattr(self, f"lora_{name}", Adapter(rngs, a.lora, *inputs, *outputs, spec.execution.adapter_dropout))
        for name in ("wq", "wk", "wv", "wo", "wg")[: 5 if a.attention_gate else 4] if a.lora.quantised else ():
            quantised.store(self, name, a.lora.quantised)
        if a.qk_norm:
            self.q_norm, self.k_norm = (RMSNorm(h, a.norm_eps, "head_dim", a.centred_norms) for _ in "qk")
        self.window = a.sliding_window if local else 0
        if a.attention_sinks:  # a logit, not a matrix: no weight decay (spec.is_matrix)
            self.sinks = nnx.Param(jnp.zeros((n,), jnp.float32), sharding_names=("heads",), eager_sharding=False)
        # The kernels scale scores by head_dim^-0.5; another scale (Gemma's query_pre_attn_scalar) goes on q.
        self.q_scale = (h / a.attn_scale_dim) ** 0.5 if a.attn_scale_dim else 1.0
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x, tables, segment_ids, cache=None, key=None):
        """`tables`: {"global": ..., "local": ...} RoPE tables. With `cache` = (k_cache, v_cache, positions) (a
        local layer's: (k_ring, v_ring, ring positions, positions)), writes this call's keys and values and
        attends over the cache; returns (output, updated cache). `key`: the adapters' dropout key (training)."""
        dt = self.execution.compute_dtype
        tables = tables["local" if self.window else "global"]
        run = self.execution
        q = einsum("btd,dnh->btnh", x, weight(self, "wq", dt), run, "attention")
        q_added, gate_added = update(self, "q", x, key), None
        if q_added is not None:
            h = q.shape[-1]
            q, gate_added = q + q_added[..., :h], q_added[..., h:]
        k = adapted(self, "k", einsum("btd,dkh->btkh", x, weight(self, "wk", dt), run, "attention"), x, key)
        v = adapted(self, "v", einsum("btd,dkh->btkh", x, weight(self, "wv", dt), run, "attention"), x, key)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale != 1.0:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        q = self.shard.constrain(apply_rope(q, tables), ("batch", "seq", "heads", "head_dim"))
        k = self.shard.constrain(apply_rope(k, tables), ("batch", "seq", "kv_heads", "head_dim"))
        v = self.shard.constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        sinks = self.sinks[...] if hasattr(self, "sinks") else None
        if cache is None:
            run = self.execution
            out = attend(run.attention, q, k, v, segment_ids, self.shard, run.context_attention, self.window, sinks)
            new_cache = None
        elif self.window:
            out, new_cache = ring_attention(q, k, v, *cache, self.window, sinks)
        else:
            k_cache, v_cache, positions = cache
            # Each row writes at its own position: prompts of different lengths decode side by side.
            write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice_in_dim(c, new, at, axis=0))
            # A call all padding (-1: a prefill chunk past a row's prompt) writes at the end, as a negative start
            # counts from there: slots in every query's future until generation writes them.
            k_cache = write(k_cache, k.astype(k_cache.dtype), positions[:, 0])
            v_cache = write(v_cache, v.astype(v_cache.dtype), positions[:, 0])
            out, new_cache = cached_attention(q, k_cache, v_cache, positions, sinks), (k_cache, v_cache)
        if hasattr(self, "wg"):
            gate = einsum("btd,dnh->btnh", x, weight(self, "wg", dt), run, "attention")
            gate = gate if gate_added is None else gate + gate_added
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        projected = einsum("btnh,nhd->btd", out, weight(self, "wo", dt), self.execution, "attention")
        return adapted(self, "o", projected, out, key), new_cache


class Block(nnx.Module):
    """Attention and an MLP, each after its norm (and with model.post_norms normed again) and added to the
    residual stream; with `moe`, the MLP is a mixture of experts (trainer/model/moe.py); `local`: attention
    over the sliding window; `linear`: Gated DeltaNet in attention's place (trainer/model/delta.py)."""

    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs, moe: bool = False,
                 local: bool = False, linear: bool = False):  # fmt: skip
        a = spec.arch
        self.attn_norm = RMSNorm(a.d_model, a.norm_eps, centred=a.centred_norms)
        if linear:
            self.attn = GatedDeltaNet(spec, shard, rngs)
        else:
            self.attn = LatentAttention(spec, shard, rngs) if a.mla.kv_rank else Attention(spec, shard, rngs, local)
        self.mlp_norm = RMSNorm(a.d_model, a.norm_eps, centred=a.centred_norms)
        if a.post_norms:
            self.attn_out_norm, self.mlp_out_norm = (RMSNorm(a.d_model, a.norm_eps, centred=a.centred_norms)
                                                     for _ in "am")  # fmt: skip
        if moe:
            self.moe = MoE(spec, shard, rngs)
        else:
            self.mlp = MLP(spec, shard, rngs)
        self.shard = shard

    def __call__(self, x, tables, segment_ids, cache=None, key=None):
        """(the residual stream after the block, the updated cache, the MoE layer's statistics or {}). `key`:
        the layer's dropout key for its adapters (training steps with model.lora.dropout), else None."""
        keys = (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
        attended, cache = self.attn(self.attn_norm(x), tables, segment_ids, cache, keys[0])
        if hasattr(self, "attn_out_norm"):
            attended = self.attn_out_norm(attended)
        x = x + attended
        if hasattr(self, "moe"):
            out, stats = self.moe(self.mlp_norm(x), None if segment_ids is None else segment_ids > 0, keys[1])
        else:
            out, stats = self.mlp(self.mlp_norm(x), keys[1]), {}
        if hasattr(self, "mlp_out_norm"):
            out = self.mlp_out_norm(out)
        return self.shard.constrain(x + out, RESIDUAL), cache, stats
