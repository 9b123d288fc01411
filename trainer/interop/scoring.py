"""What a benchmark harness asks of a model, in token ids: the log-likelihood of a continuation after a
context, and greedy continuations of prompts; every request on its own, batched, on any mesh.

Scoring: each request is one row (context then continuation, less the last token), never packed with
another, right-padded to the shortest of a few lengths (data.seq_len halved while the mesh still takes
it) that holds the longest row of its batch: attention is causal, so the padding after a row's tokens
changes none of its log-probabilities, and one compile serves every batch of a length. A batch has the
training microbatch's rows (train.global_batch_size / train.grad_accum_steps), which every mesh of the
run takes, and is laid out like a training batch: a row's tokens sit in segment 1, padding in segment 0.
Experts run without a capacity here and padding is routed to none (spec.for_inference, moe.route), so no
request's tokens lose their experts to another's.
Each process builds the whole batch (all hold every request) and gives its devices their part.

Generation: prompts side by side, right-padded to a power of two, each going on from its own end
(trainer/model/sampling.py), greedy, for a fixed number of new tokens.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from parallelism.distributed import fetch
from trainer.config import microbatch_size
from trainer.model.context import ways
from trainer.model.sampling import make_generate
from trainer.training.setup import Setup

SHORTEST = 16  # no length bucket below this: a call costs little less, and each length is a compile
GENERATE_ROWS = 8  # prompts decoded side by side (the cache is whole on every device: a few rows at a time)


def lengths(setup: Setup) -> list[int]:
    """The padded lengths a scoring batch can have, longest first: data.seq_len halved while the halves still
    split into the context axis's 2 x context chunks."""
    longest, granule = setup.cfg.data.seq_len, 2 * ways(setup.shard)
    out = [longest]
    while out[-1] % 2 == 0 and out[-1] // 2 >= SHORTEST and (out[-1] // 2) % granule == 0:
        out.append(out[-1] // 2)
    return out


class Scorer:
    """Log-likelihoods and greedy continuations from parameters placed as `setup` says, compiled once per
    shape for all the parameters it is given. `watch` has `progress()` (called after every batch) and
    `suspended()` (around each compile): the training loop's hang watch; by default nothing."""

    def __init__(self, setup: Setup, watch=None):
        self.setup, self._watch = setup, watch
        self.max_length = setup.cfg.data.seq_len  # the context the model was trained on
        self.rows = microbatch_size(setup.cfg)
        self._lengths = lengths(setup)
        self._score = jax.jit(self._score_rows, out_shardings=setup.shard.replicated())
        self._compiled: set[tuple] = set()
        self._generators: dict[int, object] = {}

    def loglikelihoods(self, params, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability of `continuation` after `context`, whether greedy decoding gives it) for each
        (context, continuation) of token ids: context non-empty, and the two together at most max_length + 1
        tokens (the caller truncates from the left)."""
        for context, continuation in requests:
            assert context and continuation and len(context) + len(continuation) <= self.max_length + 1
        order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i])))  # like lengths together
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.rows):
            chunk = order[start : start + self.rows]
            batch = self._batch([requests[i] for i in chunk])
            with self._compiling(("score", batch["tokens"].shape)):
                sums, greedy = fetch(self._score(params, self._placed(batch)))
            for row, i in enumerate(chunk):
                out[i] = (float(sums[row]), bool(greedy[row]))
            self._progress()
        return out

    def greedy(self, params, prompts: list[list[int]], new_tokens: int) -> list[np.ndarray]:
        """`new_tokens` greedy tokens after each prompt (whose length plus new_tokens is at most max_length)."""
        generate = self._generators.get(new_tokens)
        if generate is None:
            generate = self._generators[new_tokens] = make_generate(
                self.setup.spec, self.setup.shard, max_new_tokens=new_tokens
            )
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        out: list[np.ndarray | None] = [None] * len(prompts)
        for start in range(0, len(order), GENERATE_ROWS):
            chunk = order[start : start + GENERATE_ROWS]
            width = 1 << (max(len(prompts[i]) for i in chunk) - 1).bit_length()
            tokens = np.zeros((GENERATE_ROWS, width), np.int32)
            ends = np.ones(GENERATE_ROWS, np.int32)
            for row, i in enumerate(chunk):
                tokens[row, : len(prompts[i])], ends[row] = prompts[i], len(prompts[i])
            with self._compiling(("generate", new_tokens, width)):
                continuations = np.asarray(generate(params, tokens, 0, ends))
            for row, i in enumerate(chunk):
                out[i] = continuations[row]
            self._progress()
        return out

    def _batch(self, requests) -> dict[str, np.ndarray]:
        needed = max(len(c) + len(t) - 1 for c, t in requests)
        length = min(n for n in self._lengths if n >= needed)
        b = {k: np.zeros((self.rows, length), np.int32) for k in ("tokens", "segment_ids", "next", "scored")}
        b["positions"] = np.tile(np.arange(length, dtype=np.int32), (self.rows, 1))
        for row, (context, continuation) in enumerate(requests):
            ids = (context + continuation)[:-1]
            b["tokens"][row, : len(ids)] = ids
            b["segment_ids"][row, : len(ids)] = 1
            scored = slice(len(ids) - len(continuation), len(ids))  # the positions that predict the continuation
            b["next"][row, scored], b["scored"][row, scored] = continuation, 1
        return b

    def _placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The whole batch (every process holds it) as global arrays split like a training batch."""
        sharding = self.setup.batch_sharding
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
                for k, v in batch.items()}  # fmt: skip

    def _score_rows(self, params, batch):
        logits = self.setup.inference_model.apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
        # log p = logit - log Z, without a second (rows, length, vocab) array of log-probabilities.
        picked = jnp.take_along_axis(logits, batch["next"][..., None], axis=-1)[..., 0]
        picked = picked - jax.nn.logsumexp(logits, axis=-1)
        scored = batch["scored"] > 0
        sums = jnp.sum(jnp.where(scored, picked, 0.0), axis=-1)
        greedy = jnp.all(~scored | (jnp.argmax(logits, axis=-1) == batch["next"]), axis=-1)
        return sums, greedy

    def _compiling(self, key):
        if key in self._compiled or self._watch is None:
            return contextlib.nullcontext()
        self._compiled.add(key)
        return self._watch.suspended()

    def _progress(self) -> None:
        if self._watch is not None:
            self._watch.progress()
