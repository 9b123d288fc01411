"""Validation loss on a fixed set of held-out batches.

The same `train.eval_batches` batches (the first of the eval split, unshuffled)
are used at every evaluation, so successive numbers compare like with like.
`unigram_loss` is the entropy of the target tokens in those batches: the loss
of the best model that ignores context, the bar any language model must clear.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from trainer.data import pipeline
from trainer.loss import target_weights
from trainer.setup import Setup
from trainer.step import jit_eval_step, make_eval_step


class Evaluator:
    def __init__(self, setup: Setup, rows: list[int]):
        cfg = setup.cfg
        stream = iter(pipeline.batches(cfg, cfg.data.eval_split, rows, shuffle=False))
        self._batches = list(itertools.islice(stream, cfg.train.eval_batches))
        self._setup = setup
        self._step = jit_eval_step(make_eval_step(setup.model), setup.state_shardings, setup.shard)

    def __call__(self, params) -> dict[str, float]:
        setup = self._setup
        total, count = 0.0, 0.0
        for local in self._batches:
            batch = pipeline.to_global(local, setup.batch_sharding, setup.cfg.train.global_batch_size)
            s, n = jax.device_get(self._step(params, batch))
            total, count = total + float(s), count + float(n)
        return {"eval_loss": total / max(count, 1.0), "eval_tokens": count}

    def unigram_loss(self) -> float:
        """Entropy (nats) of this process's eval target tokens."""
        vocab = self._setup.cfg.model.vocab_size
        counts = np.zeros(vocab)
        for b in self._batches:
            targets, weights = (np.asarray(a) for a in target_weights(b["tokens"], b["segment_ids"]))
            counts += np.bincount(targets[weights > 0], minlength=vocab)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())
