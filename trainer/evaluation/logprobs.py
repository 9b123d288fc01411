"""A checkpoint's next-token log-probabilities for a text, position by position: the numbers to hold beside
another implementation's (transformers' on the export, vLLM's) when checking that a model reads as it should.

The text is read as training reads a document: the tokenizer's begin-of-document id, then its tokens. Position
i's figures are the model's prediction of token i + 1 from tokens 0..i, in float64 from the float32 logits.
"""

from __future__ import annotations

import jax
import numpy as np

from trainer.config.errors import ConfigError
from trainer.data import run_tokenizer
from trainer.data.tokenizers import load_tokenizer
from trainer.evaluation.samples import prompt_ids
from trainer.training.resume import load_params


def score_text(cfg, workdir: str, step: int | None, text: str, top: int = 5) -> dict:
    """{"step", "tokens", "logprobs" (of each next token), "sum" (their sum), "top" (each position's `top` most
    likely next ids with their log-probabilities), "logits" (numpy, positions x vocabulary)}."""
    cfg = run_tokenizer.settle(cfg, workdir)  # the run's own copy of its tokenizer
    ids = prompt_ids(load_tokenizer(cfg.data), text)
    if len(ids) > cfg.model.max_seq_len:
        raise ConfigError(f"the text is {len(ids)} tokens with its begin-of-document id, more than "
                          f"model.max_seq_len={cfg.model.max_seq_len}; shorten it.")  # fmt: skip
    if not 0 <= top <= cfg.model.vocab_size:
        raise ConfigError(f"--top={top}: give 0 to {cfg.model.vocab_size} (model.vocab_size).")
    setup, step, params = load_params(cfg, workdir, step)
    logits = np.asarray(jax.jit(setup.inference_model.apply)(params, ids[None]))[0]
    wide = logits.astype(np.float64)
    log_p = wide - wide.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    following = [float(log_p[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    best = np.argsort(-log_p, axis=-1, kind="stable")[:, :top]
    return {"step": step, "tokens": ids.tolist(), "logprobs": following, "sum": float(sum(following)),
            "top": [[[int(t), float(log_p[i, t])] for t in row] for i, row in enumerate(best)],
            "logits": logits}  # fmt: skip
