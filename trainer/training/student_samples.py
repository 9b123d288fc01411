"""On-policy distillation (distill.on_policy, GKD's lmbda; Agarwal et al. 2024): a share of the steps train on
the student's own text instead of the batch's.

Whether step s is one is drawn from (train.seed, s) alone, so a resumed run draws the same steps. On such a
step every row keeps the first half of its window as a prompt and the student (the weights it applies now,
adapters joined) samples the second half, at distill.sample_temperature as TRL's GKD samples; the row is then read
as one sequence (positions from 0, one segment), as the sampler read it. The step takes the divergence from
the teacher on the sampled tokens alone and no cross-entropy (there is no data to be faithful to there);
the batch carries which tokens were sampled (`sampled`, (batch, seq), 1 on them), and the log
`distill/on_policy` (1 on such a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trainer.model.sampling import make_generate

KEY = "sampled"  # the batch's field: 1 on the tokens the student sampled


class StudentSamples:
    """Turns a step's batch into the student's own continuations of it, on the steps drawn for that."""

    def __init__(self, setup):
        cfg = setup.cfg
        self.share, self.seed = cfg.distill.on_policy, cfg.train.seed
        seq = cfg.data.seq_len
        self.prompt = seq // 2
        self.generate = make_generate(setup.spec, setup.shard, max_new_tokens=seq - self.prompt,
                                      temperature=cfg.distill.sample_temperature, split_batch=True)  # fmt: skip
        self.assemble = jax.jit(self._assembled, static_argnums=2, out_shardings=setup.batch_sharding)

    def chosen(self, step: int) -> bool:
        """Whether step `step` (0 the first) trains on the student's samples."""
        return bool(np.random.default_rng([self.seed, step]).random() < self.share)

    def __call__(self, weights: dict, batch: dict, step: int) -> dict:
        """The batch step `step` trains on: `batch` with no token marked sampled, or the student's own."""
        if not self.chosen(step):
            return {**batch, KEY: jnp.zeros_like(batch["tokens"])}
        seed = int(np.random.default_rng([self.seed, step, 1]).integers(2**31))
        new = self.generate(weights, batch["tokens"][:, : self.prompt], seed)
        return self.assemble(batch["tokens"], new, self.prompt)

    @staticmethod
    def _assembled(tokens: jax.Array, new: jax.Array, prompt: int) -> dict:
        rows, seq = tokens.shape
        where = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
        return {
            "tokens": jnp.concatenate([tokens[:, :prompt], new.astype(tokens.dtype)], axis=1),
            "positions": where,
            "segment_ids": jnp.ones_like(where),
            KEY: (where >= prompt).astype(jnp.int32),
        }
