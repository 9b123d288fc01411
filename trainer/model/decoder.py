"""A LLaMA-style decoder in Flax NNX, with every parameter named by logical axes.

tokens -> embedding -> n x [RMSNorm -> GQA attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> logits.

Layers are created stacked (one array per weight with a leading 'layers' axis)
and run by `jax.lax.scan`, so compile time does not grow with depth; layers of
different kinds (dense and MoE, local and global) live in separate stacks, and
a repeating pattern of them runs as one scan over its units (`layer_plan`). Three
ways through them, one method each: `features` (training and evaluation:
scan, unrolled loop or pipeline stages, under the remat policy), `decode` (a
KV cache, for generation) and `hidden_states` (every layer's output, for
muP's coordinate check).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallelism import pipeline
from parallelism.rules import LogicalSharding
from trainer.model.context import ways, zigzag
from trainer.model.layers import RESIDUAL, Block
from trainer.model.low_precision import einsum
from trainer.model.mtp import MTPModule, mtp_sums
from trainer.model.primitives import RMSNorm, param, rope_tables
from trainer.model.spec import LAYERS, REMAT, Architecture, ModelSpec
from trainer.objectives.language_model import chunked_loss_sums, chunked_target_logprobs, target_weights

NO_SHARDING = LogicalSharding.create(None)


class Decoder(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding = NO_SHARDING, *, rngs: nnx.Rngs):
        a = spec.arch
        self.embed = param(rngs, (a.vocab_size, a.d_model), ("vocab", "embed"), spec.init_std)

        def stacked_blocks(count: int, moe: bool, local: bool, linear: bool):
            @nnx.split_rngs(splits=count)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def create(rngs):
                return Block(spec, shard, rngs, moe, local, linear)

            return create(rngs)

        # Like blocks in one stack each (spec.Architecture.stacks): a mixture's dense first layers, the dense
        # ones between its MoE layers, and the MoE layers (a dense model's every layer); local and global; or
        # a hybrid's linear and full-attention layers.
        counts = collections.Counter(stack for stack, _ in a.stacks())
        for stack, count in counts.items():
            linear = stack == "linear_layers"
            setattr(self, stack, stacked_blocks(count, a.moe_stack(stack), stack == "local_layers", linear))
        self.final_norm = RMSNorm(a.d_model, a.norm_eps, centred=a.centred_norms)
        if a.mtp.depth:

            @nnx.split_rngs(splits=a.mtp.depth)
            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def modules(rngs):
                return MTPModule(spec, shard, rngs)

            self.mtp = modules(rngs)
        if not a.tie_embeddings:
            self.lm_head = param(rngs, (a.d_model, a.vocab_size), ("embed", "vocab"), spec.init_std)
        self.arch, self.execution, self.shard = a, spec.execution, shard

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """fp32 logits (batch, seq, vocab). Positions default to 0..seq-1."""
        chex.assert_rank(tokens, 2)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.logits(self.features(tokens, positions, segment_ids))

    def loss_sums(self, tokens, positions, segment_ids, loss_mask=None, dropout_key=None):
        """Next-token (cross-entropy sum, token count, log(Z)^2 sum, largest |logit|; see loss.py), and the MoE
        layers' statistics ({} without experts; each (moe layers, ...), see moe.py). `loss_mask`: the tokens
        trained on (post-training), all where None. `dropout_key`: a training step's key for the adapters'
        dropout (model.lora.dropout); None: none."""
        targets, weights = target_weights(tokens, segment_ids, loss_mask)
        order = self._order(tokens.shape[1])
        if order is not None:  # each position's loss is its own: taken in the layers' order, nothing moves back
            targets, weights = targets[:, order], weights[:, order]
        features, stats, hidden = self._through_layers(tokens, positions, segment_ids, dropout_key)
        if self.arch.mtp.depth:  # validation keeps the context axis away: the sequence is in its own order
            stats = {**stats, "mtp": mtp_sums(self.mtp, self._embed, self.logits, hidden, tokens,
                                              self._tables(positions), segment_ids, loss_mask,
                                              self.execution.loss_chunk)}  # fmt: skip
        return (*chunked_loss_sums(self.logits, features, targets, weights, self.execution.loss_chunk), stats)

    def target_logprobs(self, tokens, positions, segment_ids, dropout_key=None, temperature: float = 1.0,
                        entropy: bool = False):  # fmt: skip
        """(each position's log-probability of the next token, (batch, seq) fp32, in the sequence's order; the
        MoE layers' statistics). `temperature` divides the logits first (a sampler's distribution); with
        `entropy` the first is (log-probabilities, each position's entropy)."""
        targets = target_weights(tokens, segment_ids)[0]
        order = self._order(tokens.shape[1])
        features, stats, _ = self._through_layers(tokens, positions, segment_ids, dropout_key)
        if order is not None:
            targets = targets[:, order]
        logits = self.logits if temperature == 1.0 else (lambda x: self.logits(x).astype(jnp.float32) / temperature)
        out = chunked_target_logprobs(logits, features, targets, self.execution.loss_chunk, entropy)
        return (out if order is None else jax.tree.map(lambda o: o[:, np.argsort(order)], out)), stats

    def trained_features(self, tokens, positions, segment_ids, dropout_key=None):
        """(the final-normed residual stream in the sequence's order, the MoE layers' statistics): for an
        objective with a head of its own over the features (distillation's, trainer/objectives/distill.py).
        `dropout_key`: as loss_sums'."""
        order = self._order(tokens.shape[1])
        x, stats, _ = self._through_layers(tokens, positions, segment_ids, dropout_key)
        return (x if order is None else x[:, np.argsort(order)]), stats

    def features(self, tokens, positions, segment_ids) -> jax.Array:
        """The final-normed residual stream (batch, seq, d_model), through the layers as the execution says."""
        order = self._order(tokens.shape[1])
        x = self._through_layers(tokens, positions, segment_ids)[0]
        return x if order is None else x[:, np.argsort(order)]

    def _through_layers(self, tokens, positions, segment_ids, dropout_key=None):
        """(features in the layers' order, MoE statistics, the last layer's output before the final norm).
        With the sequence split over the context axis the layers see it in zig-zag order
        (trainer/model/context.py)."""
        # A transposed or mis-sliced segment/position array would broadcast silently.
        chex.assert_equal_shape([tokens, positions, *(() if segment_ids is None else (segment_ids,))])
        order = self._order(tokens.shape[1])
        if order is not None:
            tokens, positions = tokens[:, order], positions[:, order]
            segment_ids = None if segment_ids is None else segment_ids[:, order]
        hidden, stats = self._layers(tokens, positions, segment_ids, dropout_key)
        return self.final_norm(hidden), stats, hidden

    def _order(self, seq_len: int) -> np.ndarray | None:
        context = ways(self.shard)
        return None if context == 1 else zigzag(seq_len, context)

    def _layers(self, tokens, positions, segment_ids, dropout_key=None):
        run = self.execution
        x = self._embed(tokens)
        if run.stages > 1:  # dense global layers only (validation refuses experts and windows in a pipeline)
            graphdef, stacked = nnx.split(self.layers)
            layer = _remat(lambda x, params, tables, ids: nnx.merge(graphdef, params)(x, tables, ids)[0], run)
            return self._pipelined(layer, stacked, x, positions, segment_ids), {}
        tables = self._tables(positions)

        def block(graphdef, params, x, key):
            x, _, stats = nnx.merge(graphdef, params)(x, tables, segment_ids, key=key)
            return x, stats

        keys = None
        if dropout_key is not None:  # a key for each layer, taken with its weights through the scans
            counts = collections.Counter(stack for stack, _ in self.arch.stacks())
            keys = {stack: jax.random.split(jax.random.fold_in(dropout_key, i), n)
                    for i, (stack, n) in enumerate(counts.items())}  # fmt: skip
        x, outs = self._run(block, x, keys, remat=True)
        if self.arch.layer_types and self.arch.moe.num_experts:  # a hybrid's experts: in both stacks
            return x, self._in_order(outs)
        return x, outs.get("layers", {})  # the MoE layers' statistics ({} from dense blocks)

    def _tables(self, positions) -> dict:
        """RoPE tables for the global layers and the local ones (the same unless model.local_rope_theta)."""
        a = self.arch
        tables = {"global": rope_tables(positions, a.rope_dim, a.rope_theta, a.rope_scaling)}
        local = a.local_rope_theta and a.local_rope_theta != a.rope_theta
        tables["local"] = (
            rope_tables(positions, a.rope_dim, a.local_rope_theta, a.rope_scaling) if local else tables["global"]
        )
        return tables

    def _run(self, block, x, inputs: dict | None = None, remat: bool = False):
        """The layers in the model's order: `block(graphdef, params, x, its inputs) -> (x, output)` for each
        (under the remat policy if `remat`), `inputs` {stack: a tree whose leaves lead with that stack's layer
        axis} or None. Returns (x, {stack: its layers' outputs, leading with its layer axis}). The layers run
        as `layer_plan` lays them out: scans over runs of one stack (a loop without scan_layers), and one scan
        over the units of a repeating pattern (a mixture's dense layers and the MoE one after them, Gemma 3's
        five local layers and a global one)."""
        scan = jax.lax.scan if self.execution.scan_layers else _loop
        layers, cursor, outs = {}, collections.Counter(), collections.defaultdict(list)
        for stack in dict.fromkeys(s for s, _ in self.arch.stacks()):
            graphdef, params = nnx.split(getattr(self, stack))
            layer = functools.partial(block, graphdef)
            if remat:
                layer = _remat(layer, self.execution)
            # (x, (params, inputs)) -> (x, output), as a scan's body takes them
            layers[stack] = (lambda x, p, layer=layer: layer(p[0], x, p[1]), (params, (inputs or {}).get(stack)))

        def take(stack: str, count: int):
            start = cursor[stack]
            cursor[stack] += count
            return jax.tree.map(lambda a: a[start : start + count], layers[stack][1])

        def through(x, runs, xs):
            """x through `runs` [(stack, count)], each stack's layers taken in turn from xs[stack]."""
            used, out = collections.Counter(), collections.defaultdict(list)
            for stack, count in runs:
                part = jax.tree.map(lambda a, u=used[stack], n=count: a[u : u + n], xs[stack])
                used[stack] += count
                if count == 1:  # one layer: no loop around it
                    x, o = layers[stack][0](x, jax.tree.map(lambda a: a[0], part))
                    o = jax.tree.map(lambda a: a[None], o)
                else:
                    x, o = scan(layers[stack][0], x, part)
                out[stack].append(o)
            return x, {s: _joined(o) for s, o in out.items()}

        for units, runs in layer_plan(tuple(s for s, _ in self.arch.stacks())):
            counts = collections.Counter()
            for stack, count in runs:
                counts[stack] += count
            if units == 1:
                x, o = through(x, runs, {s: take(s, c) for s, c in counts.items()})
            else:  # one scan over the units, each unit's layers of a stack as one leading axis
                xs = {s: jax.tree.map(lambda a, c=c, u=units: a.reshape(u, c, *a.shape[1:]), take(s, units * c))
                      for s, c in counts.items()}  # fmt: skip
                x, o = scan(lambda x, xs, runs=runs: through(x, runs, xs), x, xs)
                o = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), o)
            for stack, out in o.items():
                outs[stack].append(out)
        return x, {stack: _joined(out) for stack, out in outs.items()}

    def _in_order(self, outs: dict):
        """Each stack's per-layer outputs put back in the model's layer order, as one tree."""
        order = self.arch.stacks()
        stacks = list(dict.fromkeys(s for s, _ in order))
        offset = dict(zip(stacks, np.cumsum([0, *(jax.tree.leaves(outs[s])[0].shape[0] for s in stacks)]),
                          strict=False))  # fmt: skip
        index = np.array([offset[stack] + place for stack, place in order])
        joined = jax.tree.map(lambda *a: jnp.concatenate(a), *(outs[s] for s in stacks))
        return jax.tree.map(lambda a: a[index], joined)

    def decode(self, tokens, positions, cache: dict, last: jax.Array | None = None):
        """Logits for `tokens` at `positions` given a KV cache of earlier positions; returns (logits, cache).

        `cache` is {stack: (k, v)} (trainer/model/sampling.py `empty_cache`), each (layers, batch, max_len,
        kv_heads, head_dim); a local stack's (k, v, ring positions) rings of `sliding_window` slots. One call
        can prefill a whole prompt or extend by a token; a position of -1 is padding, which a ring never
        takes in. With `last` (batch,), each row's logits at that position alone, (batch, 1, vocab): a
        prefill needs no more, and a batch of long prompts' every logit would outweigh the cache.
        """
        chex.assert_equal_shape([tokens, positions])
        tables = self._tables(positions)

        def block(graphdef, params, x, kv):
            x, kv, _ = nnx.merge(graphdef, params)(x, tables, None, (*kv, positions))
            return x, kv

        x, outs = self._run(block, self._embed(tokens), {stack: tuple(kv) for stack, kv in cache.items()})
        if last is not None:
            x = x[jnp.arange(x.shape[0]), last][:, None]
        return self.logits(self.final_norm(x)), outs

    def hidden_states(self, tokens) -> jax.Array:
        """The residual stream after each layer, (layers, batch, seq, d_model): for coordinate checks."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        tables = self._tables(positions)

        def block(graphdef, params, x, _):
            x = nnx.merge(graphdef, params)(x, tables, None)[0]
            return x, x

        return self._in_order(self._run(block, self._embed(tokens))[1])

    def logits(self, features: jax.Array) -> jax.Array:
        """fp32 logits from the final-normed features (batch, seq, d_model)."""
        a = self.arch
        head = self.embed[...].T if a.tie_embeddings else self.lm_head[...]
        logits = einsum("...d,dv->...v", features, head.astype(self.execution.compute_dtype), self.execution, "logits",
                        preferred_element_type=jnp.float32)  # fmt: skip
        if a.mup_base_width:
            logits = logits / a.width_multiplier  # muP's output multiplier
        return self.shard.constrain(logits, ("batch", "seq", "vocab"))

    def _embed(self, tokens) -> jax.Array:
        # Look up in the whole table, all-gathered like any FSDP weight at its
        # use: a gather from a sharded table makes XLA fall back to replicating
        # and re-partitioning its output, which costs more.
        table = _gathered(self.shard, self.embed[...].astype(self.execution.compute_dtype))
        x = table[tokens]
        if self.arch.embed_scale:  # Gemma: sqrt(d_model), rounded to the compute dtype as Gemma rounds it
            x = x * jnp.asarray(self.arch.d_model**0.5, x.dtype)
        return self.shard.constrain(x, RESIDUAL)

    def _pipelined(self, layer, stacked, x, positions, segment_ids):
        """The layers as a GPipe pipeline over mesh.stage stages (parallelism/pipeline.py)."""
        run = self.execution

        def stage(params, mb):
            tables = self._tables(mb["positions"])
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


@functools.lru_cache(maxsize=64)
def layer_plan(stacks: tuple[str, ...]) -> list[tuple[int, list[tuple[str, int]]]]:
    """How the layers, each named by its stack in the model's order, run: segments (units, runs), each
    `units` repetitions of `runs` [(stack, consecutive layers)], together the whole order. Of the ways to
    cut it into a head, a repeated unit and a tail, the one with the fewest scan bodies to compile (a
    dense model: one run; a mixture with every=2: its dense head, then units of (dense, MoE); Gemma 3's 26
    layers: 4 units of (5 local, 1 global), then 2 local)."""

    def runs(names) -> list[tuple[str, int]]:
        return [(name, len(list(group))) for name, group in itertools.groupby(names)]

    def plain(names) -> list:
        return [(1, [run]) for run in runs(names)]

    best = plain(stacks)
    n = len(stacks)
    for head in range(n):
        rest = stacks[head:]
        for period in range(1, len(rest) // 2 + 1):
            if any(rest[i] != rest[i - period] for i in range(period, len(rest))):
                continue
            units = len(rest) // period
            plan = plain(stacks[:head]) + [(units, runs(rest[:period]))] + plain(rest[units * period :])
            cost = lambda p: sum(len(r) for _, r in p)  # noqa: E731
            if cost(plan) < cost(best):
                best = plan
            break  # a longer period with this head repeats fewer times
    return best


def _joined(parts: list):
    """Per-layer outputs of consecutive parts of one stack, as one tree along the layer axis."""
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


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
