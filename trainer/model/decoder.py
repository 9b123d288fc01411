"""A LLaMA-style decoder in Flax NNX, with every parameter named by logical axes.

tokens -> embedding -> n x [RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits.

Layers are created stacked (one array per weight with a leading 'layers' axis)
and run by `jax.lax.scan`, so compile time does not grow with depth. Parameters
stay in fp32; each matmul runs in `compute_dtype`, while norms, the attention
softmax and the logits are fp32.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from parallelism import pipeline
from parallelism.rules import LogicalSharding
from trainer.model.attention import attend, cached_attention
from trainer.model.loss import chunked_loss_sums

# Named rematerialisation policies: what the backward pass may keep from the forward.
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
NO_SHARDING = LogicalSharding.create(None)
RESIDUAL = ("batch", "residual_seq", "embed")  # the residual stream between blocks


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What defines the model's function: the same weights mean the same thing only under the same values.

    A run resumes or evaluates a checkpoint only under the architecture it was
    trained with. The field names are the `model.*` config keys.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    mup_base_width: int = 0  # muP: hidden init and learning rate scale with d_model / this; logits divided by it

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def width_multiplier(self) -> float:
        """muP's m = d_model / base width (1 without muP); see trainer/optim/mup.py."""
        return self.d_model / self.mup_base_width if self.mup_base_width else 1.0

    @classmethod
    def from_config(cls, cfg) -> Architecture:
        return cls(**{f.name: cfg.model[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the function is computed: any of these may change between two runs on the same weights."""

    remat: str = "none"
    scan_layers: bool = True
    attention: str = "xla"
    compute_dtype: str = "float32"
    loss_chunk: int = 0  # sequence positions per chunk of the loss's logits (0 = all at once)
    stages: int = 1  # pipeline stages (mesh.stage); see parallelism/pipeline.py
    microbatches: int = 1  # pipeline microbatches per forward pass (train.microbatches)

    @classmethod
    def from_config(cls, cfg) -> Execution:
        m = cfg.model
        return cls(remat=m.remat, scan_layers=m.scan_layers, attention=m.attention,
                   compute_dtype=cfg.precision.compute_dtype, loss_chunk=m.loss_chunk, stages=cfg.mesh.stage,
                   microbatches=cfg.train.microbatches)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to build: its architecture, how it runs, and how its weights start."""

    arch: Architecture
    execution: Execution = Execution()
    init_std: float = 0.02

    @property
    def hidden_init_std(self) -> float:
        return self.init_std / self.arch.width_multiplier**0.5

    @classmethod
    def from_config(cls, cfg) -> ModelSpec:
        return cls(Architecture.from_config(cfg), Execution.from_config(cfg), cfg.model.init_std)


def _param(rngs: nnx.Rngs, shape, names, std: float) -> nnx.Param:
    # eager_sharding=False: placement is decided once, by jit out_shardings, not at creation.
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, sharding_names=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), sharding_names=("embed",), eager_sharding=False)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...]).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos and sin of shape (batch, seq, 1, head_dim/2) for the given positions."""
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, tables) -> jax.Array:
    """Rotate pairs (i, i + head_dim/2), the layout Hugging Face's Llama uses."""
    cos, sin = tables
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):
        a = spec.arch
        d, n, k, h = a.d_model, a.n_heads, a.n_kv_heads, a.head_dim
        std = spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5  # keeps the residual stream's growth depth-independent
        self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), out_std)
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x, tables, segment_ids, cache=None):
        """With `cache` = (k_cache, v_cache, positions), writes this call's keys and values at
        `positions` and attends over the whole cache; returns (output, updated cache)."""
        dt = self.execution.compute_dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.wq[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.wk[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.wv[...].astype(dt))
        q = self.shard.constrain(apply_rope(q, tables), ("batch", "seq", "heads", "head_dim"))
        k = self.shard.constrain(apply_rope(k, tables), ("batch", "seq", "kv_heads", "head_dim"))
        v = self.shard.constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
        if cache is None:
            out, new_cache = attend(self.execution.attention, q, k, v, segment_ids), None
        else:
            k_cache, v_cache, positions = cache
            start = positions[0, 0]  # all rows decode in step
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
            out, new_cache = cached_attention(q, k_cache, v_cache, positions), (k_cache, v_cache)
        return jnp.einsum("btnh,nhd->btd", out, self.wo[...].astype(dt)), new_cache


class MLP(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):
        a, std = spec.arch, spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5
        self.w_gate = _param(rngs, (a.d_model, a.d_ff), ("embed", "mlp"), std)
        self.w_up = _param(rngs, (a.d_model, a.d_ff), ("embed", "mlp"), std)
        self.w_down = _param(rngs, (a.d_ff, a.d_model), ("mlp", "embed"), out_std)
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x):
        dt = self.execution.compute_dtype
        gate = x @ self.w_gate[...].astype(dt)
        up = x @ self.w_up[...].astype(dt)
        hidden = self.shard.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return hidden @ self.w_down[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(spec.arch.d_model, spec.arch.norm_eps)
        self.attn = Attention(spec, shard, rngs)
        self.mlp_norm = RMSNorm(spec.arch.d_model, spec.arch.norm_eps)
        self.mlp = MLP(spec, shard, rngs)
        self.shard = shard

    def __call__(self, x, tables, segment_ids, cache=None):
        attended, cache = self.attn(self.attn_norm(x), tables, segment_ids, cache)
        x = x + attended
        x = x + self.mlp(self.mlp_norm(x))
        return self.shard.constrain(x, RESIDUAL), cache


class Decoder(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding = NO_SHARDING, *, rngs: nnx.Rngs):
        a = spec.arch
        self.embed = _param(rngs, (a.vocab_size, a.d_model), ("vocab", "embed"), spec.init_std)

        @nnx.split_rngs(splits=a.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs):
            return Block(spec, shard, rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = RMSNorm(a.d_model, a.norm_eps)
        if not a.tie_embeddings:
            self.lm_head = _param(rngs, (a.d_model, a.vocab_size), ("embed", "vocab"), spec.init_std)
        self.arch, self.execution, self.shard = a, spec.execution, shard

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """fp32 logits (batch, seq, vocab). Positions default to 0..seq-1."""
        chex.assert_rank(tokens, 2)
        # A transposed or mis-sliced segment/position array would broadcast silently.
        chex.assert_equal_shape([tokens, *(a for a in (positions, segment_ids) if a is not None)])
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.logits(self._run(tokens, positions, segment_ids, None)[0])

    def loss_sums(self, tokens, positions, segment_ids):
        """Next-token (cross-entropy sum, token count, log(Z)^2 sum, largest |logit|); see loss.py."""
        chex.assert_equal_shape([tokens, *(a for a in (positions, segment_ids) if a is not None)])
        features = self._run(tokens, positions, segment_ids, None)[0]
        return chunked_loss_sums(self.logits, features, tokens, segment_ids, self.execution.loss_chunk)

    def hidden_states(self, tokens) -> jax.Array:
        """The residual stream after each layer, (layers, batch, seq, d_model): for coordinate checks."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self._run(tokens, positions, None, None, collect=True)[2]

    def decode(self, tokens, positions, cache):
        """Logits for `tokens` at `positions` given a KV cache of earlier positions; returns (logits, cache).

        `cache` is (k, v), each (layers, batch, max_len, kv_heads, head_dim); one
        call can prefill a whole prompt or extend by a token.
        """
        chex.assert_equal_shape([tokens, positions])
        features, cache, _ = self._run(tokens, positions, None, cache)
        return self.logits(features), cache

    def _run(self, tokens, positions, segment_ids, cache, collect: bool = False):
        a, run, dt = self.arch, self.execution, self.execution.compute_dtype
        # Look up in the whole table, all-gathered like any FSDP weight at its
        # use: a gather from a sharded table makes XLA fall back to replicating
        # and re-partitioning its output, which costs more.
        table = self.shard.constrain(self.embed[...].astype(dt), (None, None))
        x = self.shard.constrain(table[tokens], RESIDUAL)
        tables = rope_tables(positions, a.head_dim, a.rope_theta)

        graphdef, stacked = nnx.split(self.layers)

        def layer(x, inputs, tables, segment_ids):
            params, layer_cache = inputs
            block_cache = None if layer_cache is None else (*layer_cache, positions)
            x, new_cache = nnx.merge(graphdef, params)(x, tables, segment_ids, block_cache)
            return x, (new_cache, x if collect else None)

        if REMAT[run.remat] is not None and cache is None:
            layer = jax.checkpoint(layer, policy=REMAT[run.remat], prevent_cse=not run.scan_layers)

        hidden = None
        if run.stages > 1 and cache is None and not collect:
            x = self._pipelined(layer, stacked, x, positions, segment_ids)
        elif run.scan_layers:
            x, (cache, hidden) = jax.lax.scan(lambda x, i: layer(x, i, tables, segment_ids), x, (stacked, cache))
        else:
            outs = []
            for i in range(a.n_layers):
                x, out = layer(x, jax.tree.map(lambda a, i=i: a[i], (stacked, cache)), tables, segment_ids)
                outs.append(out)
            cache, hidden = jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs[0] != (None, None) else (None, None)

        return self.final_norm(x), cache, hidden

    def logits(self, features: jax.Array) -> jax.Array:
        """fp32 logits from the final-normed features (batch, seq, d_model)."""
        a = self.arch
        head = self.embed[...].T if a.tie_embeddings else self.lm_head[...]
        logits = jnp.dot(features, head.astype(self.execution.compute_dtype), preferred_element_type=jnp.float32)
        if a.mup_base_width:
            logits = logits / a.width_multiplier  # muP's output multiplier
        return self.shard.constrain(logits, ("batch", "seq", "vocab"))

    def _pipelined(self, layer, stacked, x, positions, segment_ids):
        """The layers as a GPipe pipeline over mesh.stage stages (parallelism/pipeline.py)."""
        a, run = self.arch, self.execution

        def stage(params, mb):
            tables = rope_tables(mb["positions"], a.head_dim, a.rope_theta)
            body = lambda x, p: layer(x, (p, None), tables, mb.get("segment_ids"))  # noqa: E731
            return jax.lax.scan(body, mb["x"], params)[0]

        inputs = {"x": x, "positions": positions}
        if segment_ids is not None:
            inputs["segment_ids"] = segment_ids
        return pipeline.gpipe(stage, pipeline.split_stages(stacked, run.stages), inputs,
                              stages=run.stages, microbatches=run.microbatches, shard=self.shard)  # fmt: skip
