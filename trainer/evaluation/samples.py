"""What the model writes: completions of prompts, at each evaluation (`train.sample_prompts`) and from
scripts/generate.py.

A prompt is the tokenizer's begin-of-document id followed by the prompt's
tokens; a completion ends at the end-of-document id. A chat run's (data.format=chat)
prompt is a user's message through the run's chat template, and its completion, the
reply, ends at the end of the turn. At each evaluation every
prompt is completed twice, greedily and sampled (temperature 0.8, nucleus
0.95: the usual settings for looking at a model's text), with the run's seed,
so that successive evaluations differ only by what the model has learned.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from parallelism.distributed import fetch
from trainer.config.errors import ConfigError
from trainer.data import chat
from trainer.model.sampling import make_generate

SAMPLED = dict(temperature=0.8, top_p=0.95)


def prompt_ids(tokenizer, text: str) -> np.ndarray:
    return np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)]).astype(np.int32)


def completion(tokenizer, ids, ends: set[int] | None = None) -> str:
    """The text of generated `ids` up to the first of `ends` (the end-of-document id by default)."""
    ids, ends = [int(i) for i in ids], ends or {tokenizer.eos_id}
    return tokenizer.decode(ids[: next((i for i, t in enumerate(ids) if t in ends), len(ids))])


def check_request(cfg, tokenizer, text: str, new_tokens: int, names: dict[str, str], temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, ids: np.ndarray | None = None) -> None:  # fmt: skip
    """Refuse, in one sentence, a completion the model cannot make as asked: a prompt and `new_tokens` beyond
    model.max_seq_len, a top_k beyond the vocabulary, or top_k / top_p with temperature 0 (greedy, which
    ignores them). `names` says what the caller calls new_tokens, top_k, top_p and temperature. `ids`: the
    prompt's token ids where they are not `text`'s own (a message rendered through the chat template)."""
    prompt, limit = len(prompt_ids(tokenizer, text) if ids is None else ids), cfg.model.max_seq_len
    quoted = repr(text if len(text) <= 30 else text[:30] + "...")  # its start: enough to know which
    how = "with its begin-of-document id" if ids is None else "rendered through the chat template"
    if prompt >= limit:
        raise ConfigError(
            f"the prompt {quoted} ({prompt} tokens {how}) leaves no room in model.max_seq_len={limit} for a new "
            f"token; shorten it {f'to at most {limit - 2}' if ids is None else f'by at least {prompt - limit + 1}'} "
            "tokens."
        )
    if prompt + new_tokens > limit:
        raise ConfigError(
            f"the prompt {quoted} ({prompt} tokens {how}) and {names['new_tokens']}="
            f"{new_tokens} make {prompt + new_tokens} tokens, more than model.max_seq_len={limit}; ask for at most "
            f"{limit - prompt} new tokens, or shorten the prompt."
        )
    if top_k > cfg.model.vocab_size:
        raise ConfigError(
            f"{names['top_k']}={top_k} is more than the model's {cfg.model.vocab_size} token ids "
            f"(model.vocab_size); use at most {cfg.model.vocab_size}, or 0 for all."
        )
    if temperature == 0 and (top_k or top_p < 1):
        given = [f"{names['top_k']}={top_k}"] * bool(top_k) + [f"{names['top_p']}={top_p}"] * (top_p < 1)
        raise ConfigError(
            f"{' and '.join(given)} would be ignored: {names['temperature']}=0 is greedy; give a "
            f"{names['temperature']} above 0 to sample (e.g. 0.8)."
        )


def check_prompts(cfg, tokenizer) -> None:
    """Training's samples, checked as scripts/generate.py checks its request: greedy, then sampled."""
    names = dict(new_tokens="train.sample_tokens", top_k="top_k", top_p="top_p", temperature="temperature")
    for text in cfg.train.sample_prompts:
        for settings in ({}, SAMPLED):
            check_request(cfg, tokenizer, text, cfg.train.sample_tokens, names, **settings)


class Samples:
    """Callable on the parameters: [{"prompt", "greedy", "sampled"}] for `train.sample_prompts`."""

    def __init__(self, setup, tokenizer):
        cfg = setup.cfg
        n = cfg.train.sample_tokens
        self.tokenizer, self.prompts, self.seed = tokenizer, cfg.train.sample_prompts, cfg.train.seed
        # A chat run is shown its replies: each prompt a user's message through the run's chat template, each
        # completion ended at the end of the turn, as generate.py --chat talks.
        self.template = chat.template_for(cfg.data, tokenizer) if cfg.data.format == "chat" else None
        self.ends = chat.end_of_turn_ids(tokenizer, self.template) if self.template else {tokenizer.eos_id}
        self.generators = {
            "greedy": make_generate(setup.spec, setup.shard, max_new_tokens=n),
            "sampled": make_generate(setup.spec, setup.shard, max_new_tokens=n, **SAMPLED),
        }
        # Every process holds the whole prompt: it is replicated over the mesh, as are the completions.
        self.replicated = NamedSharding(setup.mesh, PartitionSpec())

    def __call__(self, params) -> list[dict[str, str]]:
        rows = []
        for text in self.prompts:
            message = [{"role": "user", "content": text}]
            ids = (prompt_ids(self.tokenizer, text) if self.template is None
                   else chat.prompt_ids(self.tokenizer, self.template, message))[None]  # fmt: skip
            prompt = jax.make_array_from_process_local_data(self.replicated, ids, ids.shape)
            row = {"prompt": text}
            for kind, generate in self.generators.items():
                row[kind] = completion(self.tokenizer, fetch(generate(params, prompt, self.seed))[0], self.ends)
            rows.append(row)
        return rows
