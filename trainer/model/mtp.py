"""Multi-token prediction (DeepSeek-V3's form), model.mtp.depth > 0: modules in sequence after the decoder.

Module k (1..depth) at position i takes the hidden state the one before left there (the decoder's last
layer output for k = 1), normed, beside the normed embedding of token i + k, projects the two back to
d_model, runs them through a block of its own (dense, global attention) and predicts token i + k + 1
through its norm and the decoder's head. The embedding and the head are the decoder's. Training adds
model.mtp.weight / depth x each module's cross-entropy sum (over the targets inside the document and the
loss mask; divided, as the main loss, by the main loss's target count) and logs each module's mean
apart; decoding, evaluation and export run the decoder alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.model.layers import Block
from trainer.model.primitives import RMSNorm, param
from trainer.model.spec import ModelSpec
from trainer.objectives.language_model import chunked_loss_sums, target_weights


class MTPModule(nnx.Module):
    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):
        a = spec.arch
        self.hidden_norm, self.embed_norm = RMSNorm(a.d_model, a.norm_eps), RMSNorm(a.d_model, a.norm_eps)
        self.proj = param(rngs, (2 * a.d_model, a.d_model), ("embed", None), spec.hidden_init_std)
        self.block = Block(spec, shard, rngs)
        self.out_norm = RMSNorm(a.d_model, a.norm_eps)
        self.execution = spec.execution

    def __call__(self, hidden, embedded, tables, segment_ids):
        """The module's hidden states (b, t, d) from the previous ones and the embeddings of the tokens ahead."""
        x = jnp.concatenate([self.hidden_norm(hidden), self.embed_norm(embedded)], axis=-1)
        return self.block(x @ self.proj[...].astype(self.execution.compute_dtype), tables, segment_ids)[0]


def mtp_sums(modules, embed, logits, hidden, tokens, tables, segment_ids, loss_mask, chunk: int) -> dict:
    """{"ce": (depth,) cross-entropy sums, "count": (depth,) target counts} of the stacked `modules` (leading
    axis: depth) after the decoder's last hidden states `hidden`; `embed` and `logits` are the decoder's."""
    graphdef, params = nnx.split(modules)
    depth = jax.tree.leaves(params)[0].shape[0]
    ces, counts = [], []
    for k in range(1, depth + 1):
        module = nnx.merge(graphdef, jax.tree.map(lambda p, i=k - 1: p[i], params))
        ahead = jnp.pad(tokens[:, k:], ((0, 0), (0, k)))  # token i + k at position i
        hidden = module(hidden, embed(ahead), tables, segment_ids)
        targets, weights = target_weights(tokens, segment_ids, loss_mask, ahead=k + 1)
        ce, count, _, _ = chunked_loss_sums(lambda f, m=module: logits(m.out_norm(f)), hidden, targets, weights, chunk)
        ces.append(ce)
        counts.append(count)
    return {"ce": jnp.stack(ces), "count": jnp.stack(counts)}
