"""Knowledge distillation: the student's next-token distribution pulled towards a teacher's, beside the data's
cross-entropy (distill.*; Hinton et al. 2015, and GKD's generalized Jensen-Shannon divergence, Agarwal et al.
2024, as TRL's GKDTrainer.generalized_jsd_loss computes it).

At each position that has a next-token target (the positions the cross-entropy counts: inside a document,
and under post-training on the trained tokens), both models' logits are divided by
distill.divergence_temperature (1 in TRL's GKD, whose own temperature only samples) and normalised; with beta
the divergence is

    0           KL(teacher || student)                           forward KL
    1           KL(student || teacher)                           reverse KL
    between     beta KL(teacher || m) + (1 - beta) KL(student || m),  m = beta teacher + (1 - beta) student

(TRL's weights, which give beta's end points their own forms). The step minimises
(1 - alpha) x the cross-entropy's mean + alpha x the divergence's mean over those positions.

Online, the teacher's logits come from its own forward pass in the step (its features and head, in chunks of
model.loss_chunk positions as the student's are). Offline, each position holds the teacher's top_k logits
(ids and values; scripts/teacher_logits.py): both distributions are then taken over those k tokens alone,
each renormalised over them (the teacher's mass outside its top k is dropped, as MaxText's offline
distillation drops it, and the student's too, so that every form of the divergence stays finite). With k the
whole vocabulary that is the online divergence exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.objectives.language_model import _sums, target_weights

# Logged as distill/<name>: means over the counted positions; on_policy is 1 on a step of the student's own
# samples (trainer/training/student_samples.py), whose positions are the sampled tokens' and which has no
# cross-entropy.
METRICS = ("cross_entropy", "divergence", "on_policy")


def divergence(student_logits: jax.Array, teacher_logits: jax.Array, beta: float, temperature: float) -> jax.Array:
    """Each position's divergence (fp32, the logits' shape less the last axis) between the two distributions
    over the last axis, as the module's docstring says."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)

    def kl(p, q):  # KL(p || q) of log-probabilities
        return jnp.sum(jnp.exp(p) * (p - q), axis=-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _chunk_sums(student_logits, teacher, targets, weights, ce_weights, settings):
    """(cross-entropy sum, log(Z)^2 sum, largest |logit|, divergence sum) of one chunk; `teacher`: its logits
    over the vocabulary, or (top-k ids, their logits)."""
    ce, log_z_sq, largest = _sums(student_logits, targets, ce_weights)
    if isinstance(teacher, tuple):
        ids, values = teacher
        student_logits, teacher = jnp.take_along_axis(student_logits, ids, axis=-1), values
    div = divergence(student_logits, teacher, settings.beta, settings.divergence_temperature)
    return ce, log_z_sq, largest, jnp.sum(div * weights)


def chunked_sums(student_fn, features, teacher_fn, teacher_inputs, targets, weights, settings, chunk: int,
                 ce_weights=None):  # fmt: skip
    """(cross-entropy sum, log(Z)^2 sum, largest |logit|, divergence sum) over the positions' `weights` (the
    cross-entropy's over `ce_weights` where they differ: none on the student's own samples).
    `student_fn` / `teacher_fn` map features to fp32 logits; `teacher_inputs`: the teacher's features (online:
    teacher_fn their head) or (top-k ids, logits) (offline: teacher_fn None). With 0 < `chunk` < seq the
    sequence goes `chunk` positions at a time, each chunk's logits recomputed in the backward pass (see
    language_model.chunked_loss_sums)."""

    ce_weights = weights if ce_weights is None else ce_weights

    def sums(x, teacher, t, w, c):
        teacher = teacher if teacher_fn is None else teacher_fn(teacher)
        return _chunk_sums(student_fn(x), teacher, t, w, c, settings)

    seq = targets.shape[1]
    if not 0 < chunk < seq:
        return sums(features, teacher_inputs, targets, weights, ce_weights)

    def split(a):
        return a.reshape(a.shape[0], seq // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)

    def body(carry, inputs):
        ce, log_z_sq, largest, div = jax.checkpoint(sums)(*inputs)
        return (carry[0] + ce, carry[1] + log_z_sq, jnp.maximum(carry[2], largest), carry[3] + div), None

    zero = jnp.zeros((), jnp.float32)
    inputs = (split(features), jax.tree.map(split, teacher_inputs), split(targets), split(weights), split(ce_weights))
    return jax.lax.scan(body, (zero, zero, zero, zero), inputs)[0]


def sums(model, params, teacher_model, teacher_params, batch: dict, settings, chunk: int, key=None) -> tuple:
    """(the objective's sum over the batch's counted positions, (positions counted, log(Z)^2 sum, largest
    |logit|, MoE statistics, {metric: sum})), before the z-loss and the experts' auxiliary losses, which the
    step adds as for pretraining. Online, `teacher_model` applies `teacher_params` (never differentiated);
    offline (`teacher_model` None) the batch carries the teacher's `teacher_ids` and `teacher_logits` (batch,
    seq, top_k). `chunk`: model.loss_chunk; `key`: the student's adapters' dropout key."""
    tokens, positions, segments = batch["tokens"], batch["positions"], batch["segment_ids"]
    targets, weights = target_weights(tokens, segments, batch.get("loss_mask"))
    ce_weights, sampled = weights, jnp.zeros((tokens.shape[0], 1), jnp.float32)
    if "sampled" in batch:  # rows of the student's own samples: the divergence on them, no cross-entropy
        sampled = (jnp.max(batch["sampled"], axis=1, keepdims=True) > 0).astype(jnp.float32)
        weights = jnp.where(sampled > 0, target_weights(tokens, segments, batch["sampled"])[1], weights)
        ce_weights = weights * (1 - sampled)
    features, stats = model.apply(params, tokens, positions, segments, key, method="trained_features")

    def student_fn(x):
        return model.apply(params, x, method="logits")

    if teacher_model is None:
        teacher_fn, teacher_inputs = None, (batch["teacher_ids"], batch["teacher_logits"])
    else:
        frozen = jax.lax.stop_gradient(teacher_params)
        teacher_inputs = teacher_model.apply(frozen, tokens, positions, segments, method="features")

        def teacher_fn(x):
            return teacher_model.apply(frozen, x, method="logits")

    ce, log_z_sq, largest, div = chunked_sums(student_fn, features, teacher_fn, teacher_inputs, targets, weights,
                                              settings, chunk, ce_weights)  # fmt: skip
    objective = (1 - settings.alpha) * ce + settings.alpha * div
    on_policy = jnp.sum(sampled * jnp.sum(weights, axis=1, keepdims=True))  # the sampled rows' positions
    return objective, (jnp.sum(weights), log_z_sq, largest, stats,
                       {"cross_entropy": ce, "divergence": div, "on_policy": on_policy})  # fmt: skip
