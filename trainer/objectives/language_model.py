"""Next-token cross-entropy over packed sequences, in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def target_weights(tokens: jax.Array, segment_ids: jax.Array | None, loss_mask: jax.Array | None = None,
                   ahead: int = 1):  # fmt: skip
    """Targets (the next token, or with `ahead` the token that many positions on: multi-token prediction's)
    and 0/1 weights, both (batch, seq).

    Position t predicts token t+ahead only when both sit in the same document
    (segment id > 0, 0 being padding) and, given a `loss_mask` (post-training:
    1 on the tokens trained on), when token t+ahead is one; the last `ahead` positions have no
    target. Shapes stay (batch, seq) so the sequence axis can be sharded like any other.
    """
    k = ahead
    targets = jnp.pad(tokens[:, k:], ((0, 0), (0, k)))
    if segment_ids is None:
        valid = jnp.ones_like(tokens, bool)
    else:
        valid = jnp.pad((segment_ids[:, k:] == segment_ids[:, :-k]) & (segment_ids[:, k:] > 0), ((0, 0), (0, k)))
    if loss_mask is not None:
        valid &= jnp.pad(loss_mask[:, k:] > 0, ((0, 0), (0, k)))
    valid = valid.at[:, -k:].set(False)
    return targets, valid.astype(jnp.float32)


def _sums(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return (
        jnp.sum((log_z - target_logit) * weights),
        jnp.sum(log_z * log_z * weights),
        jnp.max(jnp.abs(logits)),
    )


def chunked_loss_sums(logits_fn, features: jax.Array, targets: jax.Array, weights: jax.Array, chunk: int):
    """(cross-entropy sum, token count, log(Z)^2 sum, largest |logit|) from features (batch, seq, d) and
    each position's target and weight (`target_weights`).

    The caller divides once per global batch. log Z (the softmax normaliser) is
    what z-loss keeps near 0, which stops the logits drifting upwards in bf16.

    `logits_fn` maps features to fp32 logits. With 0 < `chunk` < seq the
    sequence is scanned `chunk` positions at a time and each chunk's logits are
    recomputed in the backward pass, so the full (batch, seq, vocab) fp32
    logits and their gradient never exist at once: the largest activation of a
    large-vocabulary model, traded for one more head matmul.
    """
    seq = targets.shape[1]
    if not 0 < chunk < seq:
        ce, log_z_sq, largest = _sums(logits_fn(features), targets, weights)
        return ce, jnp.sum(weights), log_z_sq, largest

    def split(a):
        return a.reshape(a.shape[0], seq // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)

    @jax.checkpoint
    def chunk_sums(x, t, w):
        return _sums(logits_fn(x), t, w)

    def body(carry, inputs):
        ce, log_z_sq, largest = chunk_sums(*inputs)
        return (carry[0] + ce, carry[1] + log_z_sq, jnp.maximum(carry[2], largest)), None

    zero = jnp.zeros((), jnp.float32)
    (ce, log_z_sq, largest), _ = jax.lax.scan(
        body, (zero, zero, zero), (split(features), split(targets), split(weights))
    )
    return ce, jnp.sum(weights), log_z_sq, largest


def chunked_target_logprobs(logits_fn, features: jax.Array, targets: jax.Array, chunk: int,
                             entropy: bool = False):  # fmt: skip
    """Each position's fp32 log-probability of its target, (batch, seq): what DPO sums over a reply; with
    `entropy`, also each position's entropy of its distribution (reinforcement learning's metric). With
    0 < `chunk` < seq made `chunk` positions at a time, each chunk's logits recomputed in the backward pass
    (see chunked_loss_sums)."""

    def logprobs(x, t):
        logits = logits_fn(x).astype(jnp.float32)
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0] - log_z
        if not entropy:
            return picked
        logp = logits - log_z[..., None]
        return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    seq = targets.shape[1]
    if not 0 < chunk < seq:
        return logprobs(features, targets)

    def split(a):
        return a.reshape(a.shape[0], seq // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(lambda inputs: jax.checkpoint(logprobs)(*inputs), (split(features), split(targets)))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(targets.shape), out)
