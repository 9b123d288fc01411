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

import collections
import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallelism import pipeline
from parallelism.rules import LogicalSharding
from trainer.model.context import ways, zigzag
from trainer.model.layers import RESIDUAL, Block, RMSNorm, param, rope_tables
from trainer.model.loss import chunked_loss_sums, chunked_target_logprobs, target_weights
from trainer.model.spec import LAYERS, REMAT, Architecture, ModelSpec

NO_SHARDING = LogicalSharding.create(None)
STACKS = ("dense_layers", "dense_between", "layers")  # in the order their first layers run


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

        # Like blocks in one stack each (spec.Experts.stacks): a mixture's dense first layers, the dense ones
        # between its MoE layers, and the MoE layers (a dense model's every layer).
        counts = collections.Counter(stack for stack, _ in a.moe.stacks(a.n_layers))
        for stack in STACKS:
            if counts[stack]:
                setattr(self, stack, stacked_blocks(counts[stack], moe=stack == "layers" and a.moe.num_experts > 0))
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

    def loss_sums(self, tokens, positions, segment_ids, loss_mask=None):
        """Next-token (cross-entropy sum, token count, log(Z)^2 sum, largest |logit|; see loss.py), and the MoE
        layers' statistics ({} without experts; each (moe layers, ...), see moe.py). `loss_mask`: the tokens
        trained on (post-training), all where None."""
        targets, weights = target_weights(tokens, segment_ids, loss_mask)
        order = self._order(tokens.shape[1])
        if order is not None:  # each position's loss is its own: taken in the layers' order, nothing moves back
            targets, weights = targets[:, order], weights[:, order]
        features, stats = self._through_layers(tokens, positions, segment_ids)
        return (*chunked_loss_sums(self.logits, features, targets, weights, self.execution.loss_chunk), stats)

    def target_logprobs(self, tokens, positions, segment_ids):
        """(each position's log-probability of the next token, (batch, seq) fp32, in the sequence's order; the
        MoE layers' statistics)."""
        targets = target_weights(tokens, segment_ids)[0]
        order = self._order(tokens.shape[1])
        features, stats = self._through_layers(tokens, positions, segment_ids)
        if order is not None:
            targets = targets[:, order]
        out = chunked_target_logprobs(self.logits, features, targets, self.execution.loss_chunk)
        return (out if order is None else out[:, np.argsort(order)]), stats

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

    def _layers(self, tokens, positions, segment_ids):
        a, run = self.arch, self.execution
        x = self._embed(tokens)
        if run.stages > 1:  # dense layers only (validation refuses experts in a pipeline)
            graphdef, stacked = nnx.split(self.layers)
            layer = _remat(lambda x, params, tables, ids: nnx.merge(graphdef, params)(x, tables, ids)[0], run)
            return self.final_norm(self._pipelined(layer, stacked, x, positions, segment_ids)), {}
        tables = rope_tables(positions, a.head_dim, a.rope_theta, a.rope_scaling)

        def block(graphdef, params, x, _):
            x, _, stats = nnx.merge(graphdef, params)(x, tables, segment_ids)
            return x, stats

        x, outs = self._run(block, x, remat=True)
        return self.final_norm(x), outs["layers"]  # the MoE layers' statistics ({} from dense blocks)

    def _run(self, block, x, inputs=(), remat: bool = False):
        """The layers in the model's order: `block(graphdef, params, x, its inputs) -> (x, output)` for each
        (under the remat policy if `remat`), `inputs` a tree whose leaves lead with the layer axis (model
        order). Returns (x, each stack's outputs, leading with its own layer axis). Each stack is one scan (a
        loop without scan_layers); with MoE layers every `every`-th, one scan over units of the dense
        layers before one and that one."""
        order = self.arch.moe.stacks(self.arch.n_layers)
        mine = {stack: np.array([i for i, (s, _) in enumerate(order) if s == stack]) for stack in STACKS}
        split = {}
        for stack, i in mine.items():
            if len(i):
                graphdef, params = nnx.split(getattr(self, stack))
                layer = functools.partial(block, graphdef)
                if remat:
                    layer = _remat(layer, self.execution)
                # (x, (params, inputs)) -> (x, output), as a scan's body takes them
                split[stack] = (lambda x, p, layer=layer: layer(p[0], x, p[1]), params,
                                jax.tree.map(lambda a, i=i: a[i], inputs))  # fmt: skip
        scan = jax.lax.scan if self.execution.scan_layers else _loop
        outs = {}
        if "dense_layers" in split:
            layer, params, ins = split["dense_layers"]
            x, outs["dense_layers"] = scan(layer, x, (params, ins))
        layer, params, ins = split["layers"]
        if "dense_between" not in split:
            x, outs["layers"] = scan(layer, x, (params, ins))
            return x, outs
        dense_layer, between, between_ins = split["dense_between"]
        units = jax.tree.leaves(params)[0].shape[0]

        def unit(x, p):
            dense, moe = p
            x, dense_out = scan(dense_layer, x, dense)
            x, moe_out = layer(x, moe)
            return x, (dense_out, moe_out)

        per_unit = jax.tree.map(lambda a: a.reshape(units, -1, *a.shape[1:]), (between, between_ins))
        x, (dense_out, outs["layers"]) = scan(unit, x, (per_unit, (params, ins)))
        outs["dense_between"] = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), dense_out)
        return x, outs

    def _in_order(self, outs: dict):
        """Each stack's per-layer outputs put back in the model's layer order, as one tree."""
        order = self.arch.moe.stacks(self.arch.n_layers)
        offset = dict(zip(STACKS, np.cumsum([0, *(jax.tree.leaves(outs[s])[0].shape[0] if s in outs else 0
                                                   for s in STACKS)]), strict=False))  # fmt: skip
        index = np.array([offset[stack] + place for stack, place in order])
        joined = jax.tree.map(lambda *a: jnp.concatenate(a), *(outs[s] for s in STACKS if s in outs))
        return jax.tree.map(lambda a: a[index], joined)

    def decode(self, tokens, positions, cache):
        """Logits for `tokens` at `positions` given a KV cache of earlier positions; returns (logits, cache).

        `cache` is (k, v), each (layers, batch, max_len, kv_heads, head_dim); one
        call can prefill a whole prompt or extend by a token.
        """
        chex.assert_equal_shape([tokens, positions])
        tables = rope_tables(positions, self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)

        def block(graphdef, params, x, kv):
            x, kv, _ = nnx.merge(graphdef, params)(x, tables, None, (*kv, positions))
            return x, kv

        x, outs = self._run(block, self._embed(tokens), tuple(cache))
        return self.logits(self.final_norm(x)), self._in_order(outs)

    def hidden_states(self, tokens) -> jax.Array:
        """The residual stream after each layer, (layers, batch, seq, d_model): for coordinate checks."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        tables = rope_tables(positions, self.arch.head_dim, self.arch.rope_theta, self.arch.rope_scaling)

        def block(graphdef, params, x, _):
            x = nnx.merge(graphdef, params)(x, tables, None)[0]
            return x, x

        return self._in_order(self._run(block, self._embed(tokens))[1])

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


def _remat(layer, run):
    """`layer` under the execution's remat policy (as it is with none)."""
    if REMAT[run.remat] is None:
        return layer
    return jax.checkpoint(layer, policy=REMAT[run.remat], prevent_cse=not run.scan_layers)


def _loop(body, x, xs):
    """jax.lax.scan's result, by a Python loop (model.scan_layers=false: each layer compiled on its own)."""
    outs = []
    for i in range(jax.tree.leaves(xs)[0].shape[0]):
        x, out = body(x, jax.tree.map(lambda a, i=i: a[i], xs))
        outs.append(out)
    return x, jax.tree.map(lambda *o: jnp.stack(o), *outs)


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
