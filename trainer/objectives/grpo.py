"""Group relative policy optimisation (Shao et al. 2024), as TRL's GRPOTrainer computes it, over batches of
sampled completions (trainer/training/rollouts.py).

Each row of a batch is one completion after its prompt: `loss_mask` marks the completion's tokens (up to
and including the one it ended at), `old_logps` holds each of those tokens' log-probability under the
policy that sampled it, recomputed by the trainer at the temperature sampled at (a rollout's first update takes
its own pass's instead, `fresh`), `ref_logps` the same under
the frozen reference (rl.beta > 0), and `advantages` the completion's advantage on every position. All are
laid out by token; a position t of the model's output predicts token t + 1, so they are read one place on.

    advantage  A = (r - mean of its group) / (std of its group + 1e-4)    (grpo; TRL's scale_rewards=group,
               the std with Bessel's correction as TRL's nanstd)          dr_grpo: r - mean, no division
    ratio      ρ = exp(logp - old_logp)
    per token  -min(ρ A, clip(ρ, 1 - ε, 1 + ε) A) + β ρ (exp(ref - logp) - (ref - logp) - 1)
               (the k3 estimate of KL to the reference, weighed by ρ as TRL's use_bias_correction_kl does)
    grpo       each completion's mean over its tokens, then the mean over completions  (TRL loss_type=grpo)
    dr_grpo    each completion's sum over its tokens / rl.max_new_tokens, then the mean  (TRL loss_type=dr_grpo)

Sums over the completions are returned for the step to divide once by their count, however the batch is
accumulated or sharded. The metrics are each completion's mean over its tokens, averaged over completions
(TRL's token means over the batch weigh long completions more): kl, the clipped share of tokens (where the
clip binds: ρ < 1 - ε with A < 0, or ρ > 1 + ε with A > 0), and the entropy of the policy's distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainer.objectives.language_model import target_weights

METRICS = ("kl", "clip_fraction", "entropy")
# A batch's float fields, beside its token ones. `fresh`: 1 on the rows of a rollout's first update, 0 on its
# later ones (rl.updates_per_batch > 1), the same on every position.
FIELDS = ("old_logps", "ref_logps", "advantages", "fresh")
STD_EPS = 1e-4  # TRL's


def advantages(rewards: np.ndarray, group: int, loss: str) -> np.ndarray:
    """Each completion's advantage from the rewards (completions of a prompt adjacent, `group` of each)."""
    r = np.asarray(rewards, np.float32).reshape(-1, group)
    out = r - r.mean(axis=1, keepdims=True)
    if loss == "grpo":
        out = out / (r.std(axis=1, ddof=1, keepdims=True) + np.float32(STD_EPS))
    return out.reshape(-1).astype(np.float32)


def _ahead(x: jax.Array) -> jax.Array:
    """A field laid out by token, read at the position that predicts that token."""
    return jnp.pad(x[:, 1:], ((0, 0), (0, 1)))


def sums(model, params, batch: dict, rl, key=None) -> tuple[jax.Array, tuple]:
    """(loss sum over the batch's completions, (loss sum, completions, 0, MoE statistics, {metric: sum})).
    `key`: the adapters' dropout key (model.lora.dropout)."""
    tokens, positions, segments = batch["tokens"], batch["positions"], batch["segment_ids"]
    weights = target_weights(tokens, segments, batch["loss_mask"])[1]
    (logps, entropy), stats = model.apply(params, tokens, positions, segments, key, rl.temperature, True,
                                          method="target_logprobs")  # fmt: skip
    # A rollout's first update is on-policy: its old log-probabilities are this pass's own, detached, so the ratio
    # is exactly 1 whatever the adapters' dropout drew (TRL's old_per_token_logps=None). Later updates use those
    # the rollout recorded, without dropout.
    old = _ahead(batch["old_logps"])
    if "fresh" in batch:
        old = jnp.where(batch["fresh"] > 0, jax.lax.stop_gradient(logps), old)
    adv = _ahead(batch["advantages"])
    ratio = jnp.exp(logps - old)
    clipped = jnp.clip(ratio, 1 - rl.epsilon, 1 + rl.epsilon)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(per_token)
    if rl.beta:
        gap = _ahead(batch["ref_logps"]) - logps
        kl = jnp.exp(gap) - gap - 1
        # Times the ratio (TRL's use_bias_correction_kl, its default): the unbiased reverse-KL gradient for
        # tokens sampled by the old policy; the ratio's gradient acts even where its value is 1.
        per_token = per_token + rl.beta * kl * ratio
    counts = jnp.sum(weights, axis=-1)
    real = (jnp.max(segments, axis=-1) > 0).astype(jnp.float32)  # a row that holds a completion
    per_row = jnp.sum(per_token * weights, axis=-1)
    per_row = per_row / (jnp.maximum(counts, 1.0) if rl.loss == "grpo" else rl.max_new_tokens)
    binds = ((ratio < 1 - rl.epsilon) & (adv < 0)) | ((ratio > 1 + rl.epsilon) & (adv > 0))
    mean = lambda v: jnp.sum(jax.lax.stop_gradient(v) * weights, axis=-1) / jnp.maximum(counts, 1.0)  # noqa: E731
    values = {"kl": mean(kl), "clip_fraction": mean(binds.astype(jnp.float32)), "entropy": mean(entropy)}
    loss = jnp.sum(per_row * real)
    return loss, (loss, jnp.sum(real), jnp.float32(0.0), stats, {k: jnp.sum(v * real) for k, v in values.items()})
