"""What the model writes: completions of prompts, at each evaluation (`train.sample_prompts`) and from
scripts/generate.py.

A prompt is the tokenizer's begin-of-document id followed by the prompt's
tokens; a completion ends at the end-of-document id. At each evaluation every
prompt is completed twice, greedily and sampled (temperature 0.8, nucleus
0.95: the usual settings for looking at a model's text), with the run's seed,
so that successive evaluations differ only by what the model has learned.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from parallelism.distributed import fetch
from trainer.errors import ConfigError
from trainer.model.sampling import make_generate

SAMPLED = dict(temperature=0.8, top_p=0.95)


def prompt_ids(tokenizer, text: str) -> np.ndarray:
    return np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)]).astype(np.int32)


def completion(tokenizer, ids) -> str:
    ids = [int(i) for i in ids]
    return tokenizer.decode(ids[: ids.index(tokenizer.eos_id)] if tokenizer.eos_id in ids else ids)


def check_prompts(cfg, tokenizer) -> None:
    """Refuse a sample prompt that leaves no room for `train.sample_tokens` within model.max_seq_len."""
    for text in cfg.train.sample_prompts:
        length = len(prompt_ids(tokenizer, text)) + cfg.train.sample_tokens
        if length > cfg.model.max_seq_len:
            raise ConfigError(
                f"the sample prompt {text!r} and train.sample_tokens={cfg.train.sample_tokens} make {length} "
                f"tokens, more than model.max_seq_len={cfg.model.max_seq_len}; shorten one of them."
            )


class Samples:
    """Callable on the parameters: [{"prompt", "greedy", "sampled"}] for `train.sample_prompts`."""

    def __init__(self, setup, tokenizer):
        cfg = setup.cfg
        n = cfg.train.sample_tokens
        self.tokenizer, self.prompts, self.seed = tokenizer, cfg.train.sample_prompts, cfg.train.seed
        self.generators = {
            "greedy": make_generate(setup.spec, setup.shard, max_new_tokens=n),
            "sampled": make_generate(setup.spec, setup.shard, max_new_tokens=n, **SAMPLED),
        }
        # Every process holds the whole prompt: it is replicated over the mesh, as are the completions.
        self.replicated = NamedSharding(setup.mesh, PartitionSpec())

    def __call__(self, params) -> list[dict[str, str]]:
        rows = []
        for text in self.prompts:
            ids = prompt_ids(self.tokenizer, text)[None]
            prompt = jax.make_array_from_process_local_data(self.replicated, ids, ids.shape)
            row = {"prompt": text}
            for kind, generate in self.generators.items():
                row[kind] = completion(self.tokenizer, fetch(generate(params, prompt, self.seed))[0])
            rows.append(row)
        return rows
