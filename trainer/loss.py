"""Next-token cross-entropy over packed sequences, in fp32."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def target_weights(tokens: jax.Array, segment_ids: jax.Array | None):
    """Targets (the next token) and 0/1 weights, both (batch, seq).

    Position t predicts token t+1 only when both sit in the same document
    (segment id > 0, 0 being padding); the last position has no target.
    Shapes stay (batch, seq) so the sequence axis can be sharded like any other.
    """
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    if segment_ids is None:
        valid = jnp.ones_like(tokens, bool)
    else:
        valid = jnp.pad((segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0), ((0, 0), (0, 1)))
    valid = valid.at[:, -1].set(False)
    return targets, valid.astype(jnp.float32)


def cross_entropy_sum(logits: jax.Array, tokens: jax.Array, segment_ids: jax.Array | None):
    """(sum of token losses, number of predicted tokens, sum of log(Z)^2) over the batch.

    The caller divides once per global batch. log Z (the softmax normaliser) is
    what z-loss keeps near 0, which stops the logits drifting upwards in bf16.
    """
    chex.assert_equal_shape_prefix([logits, tokens], 2)
    targets, weights = target_weights(tokens, segment_ids)
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((log_z - target_logit) * weights), jnp.sum(weights), jnp.sum(log_z * log_z * weights)
