"""Direct preference optimisation (Rafailov et al. 2023) over packed pairs, against frozen reference weights.

A batch row holds whole pairs (trainer/data/streams.py, _PairWindows): pair k's prompt with the chosen
reply is segment 2k+1 and with the rejected one 2k+2, and `loss_mask` marks the replies' tokens. A
sequence's log-probability is the sum over its reply's tokens, for the policy (differentiated) and for the
reference (the weights of checkpoint.init_from, held apart from the state and never updated: one more
copy of the parameters on the devices, in their dtype, and one more forward pass per step, with no
backward). With Δ = (policy - reference log-prob of the chosen) - (the same of the rejected):

    sigmoid  -(1-ε) log σ(βΔ) - ε log σ(-βΔ)          (ε: dpo.label_smoothing, the conservative DPO form)
    ipo      (Δ' - 1/(2β))²   with Δ' from each reply's log-ratio divided by its length, as TRL computes it

Sums over the pairs are returned for the step to divide once by the batch's pairs (a pair is counted when
both its replies have a token in the window), however it is accumulated or sharded: the same rule as the
token mean of pretraining.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.objectives.language_model import target_weights

METRICS = ("chosen_rewards", "rejected_rewards", "margins", "accuracy", "chosen_logps", "rejected_logps")


def pair_sums(logprobs: jax.Array, weights: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of the weighted log-probabilities, tokens weighted), each (batch, pairs, 2: chosen, rejected)."""
    pairs = segment_ids.shape[1] // 2 + 1
    index = jnp.maximum(segment_ids - 1, 0)

    def row(values, counts, index):
        zero = jnp.zeros((pairs, 2), jnp.float32)
        return (zero.at[index // 2, index % 2].add(values), zero.at[index // 2, index % 2].add(counts))

    return jax.vmap(row)(logprobs * weights, weights, index)


def sums(model, params, reference, batch: dict, dpo, key=None) -> tuple[jax.Array, tuple]:
    """(loss sum over the batch's pairs, (loss sum, pairs, 0, MoE statistics, {metric: sum over pairs})).
    `key`: the policy's adapter dropout key (model.lora.dropout); the reference runs without."""
    tokens, positions, segments = batch["tokens"], batch["positions"], batch["segment_ids"]
    weights = target_weights(tokens, segments, batch["loss_mask"])[1]
    policy, stats = model.apply(params, tokens, positions, segments, key, method="target_logprobs")
    # The reference is an input the step never differentiates: no gradient reaches it, and none is computed.
    frozen = model.apply(jax.lax.stop_gradient(reference), tokens, positions, segments, method="target_logprobs")[0]
    logps, counts = pair_sums(policy, weights, segments)
    ref_logps = pair_sums(frozen, weights, segments)[0]
    valid = ((counts[..., 0] > 0) & (counts[..., 1] > 0)).astype(jnp.float32)
    ratios = logps - ref_logps  # (batch, pairs, 2)
    if dpo.loss == "ipo":
        lengths = jnp.maximum(counts, 1.0)
        delta = ratios[..., 0] / lengths[..., 0] - ratios[..., 1] / lengths[..., 1]
        losses = jnp.square(delta - 1 / (2 * dpo.beta))
    else:
        delta = ratios[..., 0] - ratios[..., 1]
        eps = dpo.label_smoothing
        losses = -(1 - eps) * jax.nn.log_sigmoid(dpo.beta * delta) - eps * jax.nn.log_sigmoid(-dpo.beta * delta)
    rewards = jax.lax.stop_gradient(dpo.beta * ratios)
    values = {
        "chosen_rewards": rewards[..., 0],
        "rejected_rewards": rewards[..., 1],
        "margins": rewards[..., 0] - rewards[..., 1],
        "accuracy": (rewards[..., 0] > rewards[..., 1]).astype(jnp.float32),
        "chosen_logps": jax.lax.stop_gradient(logps[..., 0]),
        "rejected_logps": jax.lax.stop_gradient(logps[..., 1]),
    }
    loss = jnp.sum(losses * valid)
    return loss, (loss, jnp.sum(valid), jnp.float32(0.0), stats, {k: jnp.sum(v * valid) for k, v in values.items()})
