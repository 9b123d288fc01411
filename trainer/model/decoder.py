"""A LLaMA-style decoder in Flax NNX, with every parameter named by logical axes.

tokens -> embedding -> n x [RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits.

Layers are created stacked (one array per weight with a leading 'layers' axis)
and run by `jax.lax.scan`, so compile time does not grow with depth. Three
ways through them, one method each: `features` (training and evaluation:
scan, unrolled loop or pipeline stages, under the remat policy), `decode` (a
KV cache, for generation) and `hidden_states` (every layer's output, for
muP's coordinate check).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallelism import pipeline
from parallelism.rules import LogicalSharding
from trainer.model.context import ways, zigzag
from trainer.model.layers import RESIDUAL, Block, RMSNorm, param, rope_tables
from trainer.model.loss import chunked_loss_sums, target_weights
from trainer.model.spec import LAYERS, REMAT, Architecture, ModelSpec

NO_SHARDING = LogicalSharding.create(None)


class Decoder(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding = NO_SHARDING, *, rngs: nnx.Rngs):
        a = spec.arch
        self.embed = param(rngs, (a.vocab_size, a.d_model), ("vocab", "embed"), spec.init_std)

        def stacked_blocks(count: int, moe: bool):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def create(rngs):
                return Block(spec, shard, rngs, moe)

            return create(rngs)

        # With experts, the first moe.dense_layers keep their MLP: a stack of their own, run first.
        first = a.moe.dense_layers if a.moe.num_experts else 0
        if first:
            self.dense_layers = stacked_blocks(first, moe=False)
        self.layers = stacked_blocks(a.n_layers - first, moe=a.moe.num_experts > 0)
        self.final_norm = RMSNorm(a.d_model, a.norm_eps)
        if not a.tie_embeddings:
            self.lm_head = param(rngs, (a.d_model, a.vocab_size), ("embed", "vocab"), spec.init_std)
        self.arch, self.execution, self.shard = a, spec.execution, shard

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """fp32 logits (batch, seq, vocab). Positions default to 0..seq-1."""
        chex.assert_rank(tokens, 2)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.logits(self.features(tokens, positions, segment_ids))

    def loss_sums(self, tokens, positions, segment_ids):
        """Next-token (cross-entropy sum, token count, log(Z)^2 sum, largest |logit|; see loss.py), and the MoE
        layers' statistics ({} without experts; each (moe layers, ...), see moe.py)."""
        targets, weights = target_weights(tokens, segment_ids)
        order = self._order(tokens.shape[1])
        if order is not None:  # each position's loss is its own: taken in the layers' order, nothing moves back
            targets, weights = targets[:, order], weights[:, order]
        features, stats = self._through_layers(tokens, positions, segment_ids)
        return (*chunked_loss_sums(self.logits, features, targets, weights, self.execution.loss_chunk), stats)

    def features(self, tokens, positions, segment_ids) -> jax.Array:
        """The final-normed residual stream (batch, seq, d_model), through the layers as the execution says."""
        order = self._order(tokens.shape[1])
        x = self._through_layers(tokens, positions, segment_ids)[0]
        return x if order is None else x[:, np.argsort(order)]

    def _through_layers(self, tokens, positions, segment_ids):
        """(features in the layers' order, MoE statistics). With the sequence split over the context axis the
        layers see it in zig-zag order (trainer/model/context.py)."""
        # A transposed or mis-sliced segment/position array would broadcast silently.
        chex.assert_equal_shape([tokens, positions, *(() if segment_ids is None else (segment_ids,))])
        order = self._order(tokens.shape[1])
        if order is not None:
            tokens, positions = tokens[:, order], positions[:, order]
            segment_ids = None if segment_ids is None else segment_ids[:, order]
        return self._layers(tokens, positions, segment_ids)

    def _order(self, seq_len: int) -> np.ndarray | None:
        context = ways(self.shard)
        return None if context == 1 else zigzag(seq_len, context)

    def _stacks(self) -> list:
        """The stacked blocks in order: the dense first layers of a mixture of experts, then the rest."""
        return [self.dense_layers, self.layers] if hasattr(self, "dense_layers") else [self.layers]

    def _layers(self, tokens, positions, segment_ids):
        a, run = self.arch, self.execution
        x = self._embed(tokens)
        if run.stages > 1:  # dense layers only (validation refuses experts in a pipeline)
            graphdef, stacked = nnx.split(self.layers)
            layer = self._layer(graphdef)
            x = self._pipelined(lambda *args: layer(*args)[0], stacked, x, positions, segment_ids)
            return self.final_norm(x), {}
        tables = rope_tables(positions, a.head_dim, a.rope_theta, a.rope_scaling)
        stats = {}
        for stack in self._stacks():
            graphdef, stacked = nnx.split(stack)
            layer = self._layer(graphdef)
            if run.scan_layers:
                x, stats = jax.lax.scan(lambda x, p, layer=layer: layer(x, p, tables, segment_ids), x, stacked)
            else:
                each = []
                for i in range(jax.tree.leaves(stacked)[0].shape[0]):
                    x, layer_stats = layer(x, jax.tree.map(lambda w, i=i: w[i], stacked), tables, segment_ids)
                    each.append(layer_stats)
                stats = jax.tree.map(lambda *s: jnp.stack(s), *each)
        return self.final_norm(x), stats  # the last stack's: the one with the experts

    def _layer(self, graphdef):
        """One block as a function of its parameters, under the remat policy: (x, MoE statistics)."""
        run = self.execution

        def layer(x, params, tables, segment_ids):
            x, _, stats = nnx.merge(graphdef, params)(x, tables, segment_ids)
            return x, stats

        if REMAT[run.remat] is not None:
            layer = jax.checkpoint(layer, policy=REMAT[run.remat], prevent_cse=not run.scan_layers)
        return layer

    def decode(self, tokens, positions, cache):
        """Logits for `tokens` at `positions` given a KV cache of earlier positions; returns (logits, cache).

        `cache` is (k, v), each (layers, batch, max_len, kv_heads, head_dim); one
        call can prefill a whole prompt or extend by a token.
        """
        chex.assert_equal_shape([tokens, positions])
        tables = rope_tables(positions, self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)
        x, done, caches = self._embed(tokens), 0, []
        for stack in self._stacks():
            graphdef, stacked = nnx.split(stack)
            count = jax.tree.leaves(stacked)[0].shape[0]

            def layer(x, inputs, graphdef=graphdef):
                params, k, v = inputs
                x, cache, _ = nnx.merge(graphdef, params)(x, tables, None, (k, v, positions))
                return x, cache

            x, new = jax.lax.scan(layer, x, (stacked, *(c[done : done + count] for c in cache)))
            caches.append(new)
            done += count
        cache = tuple(jnp.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*caches, strict=True))
        return self.logits(self.final_norm(x)), cache

    def hidden_states(self, tokens) -> jax.Array:
        """The residual stream after each layer, (layers, batch, seq, d_model): for coordinate checks."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        tables = rope_tables(positions, self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)
        x, states = self._embed(tokens), []
        for stack in self._stacks():
            graphdef, stacked = nnx.split(stack)

            def layer(x, params, graphdef=graphdef):
                x = nnx.merge(graphdef, params)(x, tables, None)[0]
                return x, x

            x, each = jax.lax.scan(layer, x, stacked)
            states.append(each)
        return jnp.concatenate(states)

    def logits(self, features: jax.Array) -> jax.Array:
        """fp32 logits from the final-normed features (batch, seq, d_model)."""
        a = self.arch
        head = self.embed[...].T if a.tie_embeddings else self.lm_head[...]
        logits = jnp.dot(features, head.astype(self.execution.compute_dtype), preferred_element_type=jnp.float32)
        if a.mup_base_width:
            logits = logits / a.width_multiplier  # muP's output multiplier
        return self.shard.constrain(logits, ("batch", "seq", "vocab"))

    def _embed(self, tokens) -> jax.Array:
        # Look up in the whole table, all-gathered like any FSDP weight at its
        # use: a gather from a sharded table makes XLA fall back to replicating
        # and re-partitioning its output, which costs more.
        table = _gathered(self.shard, self.embed[...].astype(self.execution.compute_dtype))
        return self.shard.constrain(table[tokens], RESIDUAL)

    def _pipelined(self, layer, stacked, x, positions, segment_ids):
        """The layers as a GPipe pipeline over mesh.stage stages (parallelism/pipeline.py)."""
        a, run = self.arch, self.execution

        def stage(params, mb):
            tables = rope_tables(mb["positions"], a.head_dim, a.rope_theta, a.rope_scaling)
            body = lambda x, p: (layer(x, p, tables, mb.get("segment_ids")), None)  # noqa: E731
            return jax.lax.scan(body, mb["x"], params)[0]

        inputs = {"x": x, "positions": positions}
        if segment_ids is not None:
            inputs["segment_ids"] = segment_ids
        return pipeline.gpipe(stage, pipeline.split_stages(stacked, run.stages), inputs, stages=run.stages,
                              microbatches=run.pipeline_microbatches, shard=self.shard)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """What is known of a model before any parameter exists: its structure, shapes and logical axes."""

    graphdef: nnx.GraphDef
    abstract_params: dict  # ShapeDtypeStructs
    logical_names: dict  # tuple of logical axis names per parameter
    arch: Architecture

    @classmethod
    def create(cls, spec: ModelSpec, shard: LogicalSharding) -> ModelDef:
        abstract = nnx.eval_shape(lambda: Decoder(spec, shard, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        names = jax.tree.map(
            lambda v: v.get_metadata()["out_sharding"], state, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
        return cls(graphdef, nnx.to_pure_dict(state), nnx.to_pure_dict(names), spec.arch)

    def apply(self, params: dict, *args, method: str = "__call__", **kwargs):
        return getattr(nnx.merge(self.graphdef, params), method)(*args, **kwargs)


def init_params(spec: ModelSpec, shard: LogicalSharding, seed) -> dict:
    """Fresh parameters as a pure dict; call it under jit to place them sharded."""
    return nnx.to_pure_dict(nnx.state(Decoder(spec, shard, rngs=nnx.Rngs(seed))))


def _gathered(shard: LogicalSharding, table: jax.Array) -> jax.Array:
    """The embedding table whole on every device, for the lookup; its gradient goes back sharded as the
    table is. A plain sharding constraint to replicated would constrain the gradient to replicated too,
    and XLA then all-reduces the whole table's gradient before slicing its shard (twice a reduce-scatter's
    traffic: 1.84 GiB a step per device for an 8B model's 128k vocabulary on v5e-16,
    benchmarks/vs_maxtext.py)."""

    @jax.custom_vjp
    def gather(t):
        return shard.constrain(t, (None, None))

    def forward(t):
        return gather(t), None

    def backward(_, g):
        return (shard.constrain(g, ("vocab", "embed")),)

    gather.defvjp(forward, backward)
    return gather(table)
