"""Reinforcement learning's prompts (data.format=prompts): a prepared corpus's rows as prompt tokens, the prompt
as the row gave it, and its answer, read by index.

A rollout batch takes the next `prompts` rows of the split, shuffled from the seed and reshuffled each epoch
as the training streams are (trainer/data/streams.py documents): batch k holds rows k * prompts onwards of
that endless order, so the batch is a function of k alone and resuming needs only the count of batches taken.
A mixture (data.mixture) draws each corpus's endless order by its weight, a share of the prompts (grain's
MapDataset.mix: a fixed interleaving, so still a function of k alone); its held-out prompts interleave the
corpora's held-out splits by the same weights, until one of them runs out.

The rows are read from the text store (the answer lives there) and rendered through the chat template with
the generation prompt, as a chat is continued; with data.tokenized the rendered prompt's tokens are read from
the tokenised store instead (the same ids, prepared once).
"""

from __future__ import annotations

import dataclasses
import json

import grain
import numpy as np

from trainer.config.errors import ConfigError
from trainer.data import chat, readers
from trainer.data.tokenizers import load_tokenizer


@dataclasses.dataclass(frozen=True)
class Prompt:
    tokens: np.ndarray  # int32: the prompt rendered up to the reply, tokenised
    prompt: object  # as the row gave it: a string or a list of messages
    answer: object  # any JSON value
    where: str  # "row N of the S split of CORPUS", for sentences that name it
    corpus: str  # its corpus's name (data.name, or a data.mixture entry's)


def rows(stream, split: str, shuffle: bool) -> grain.MapDataset:
    """The split's rows as Prompts: endless and shuffled from the seed (training), or once in order; a
    mixture's corpora interleaved by their weights."""
    drawn = [(corpus_rows(s, split, shuffle), w) for s, w in _corpora(stream)]
    if len(drawn) == 1:
        return drawn[0][0]
    return grain.MapDataset.mix([r for r, _ in drawn], [w for _, w in drawn])


def _corpora(stream):
    """(the stream of each corpus drawn from, its weight): a mixture's entries of weight > 0, or the one."""
    if not stream.mixture:
        return [(stream, 1.0)]
    weights = dict(stream.mixture)
    return [(s, weights[name]) for name, s in stream.sources().items() if weights[name] > 0]


def corpus_rows(stream, split: str, shuffle: bool) -> grain.MapDataset:
    """One corpus's rows as Prompts."""
    source = readers.open_split(dataclasses.replace(stream, tokenized=False), stream.name, split)
    stored = readers.open_split(stream, stream.name, split) if stream.tokenized else None
    tokenizer = load_tokenizer(stream)
    template = chat.template_for(stream, tokenizer)
    docs = grain.MapDataset.range(len(source))
    if shuffle:
        docs = docs.shuffle(seed=stream.seed).repeat()

    def read(i):
        row = json.loads(source[int(i)]["text"])
        where = f"row {int(i) + 1} of the {split} split of {stream.name}"
        if stored is None:
            tokens = chat.prompt_ids(tokenizer, template, chat.prompt_messages(row["prompt"], where))
        else:
            tokens = np.asarray(stored[int(i)]["tokens"], np.int32)
        return Prompt(tokens, row["prompt"], row["answer"], where, stream.name)

    return docs.map(read)


def batch(rows: grain.MapDataset, k: int, size: int) -> list[Prompt]:
    """Rollout batch k: `size` prompts."""
    return [rows[k * size + j] for j in range(size)]


def check_room(stream, split: str, max_new_tokens: int) -> None:
    """Refuse a prompt that leaves fewer than `max_new_tokens` positions of data.seq_len, naming it: every row
    of the split, of each corpus drawn from."""
    room = stream.seq_len - max_new_tokens
    for corpus, _ in _corpora(stream):
        every = corpus_rows(corpus, split, shuffle=False)
        for j in range(len(every)):
            p = every[j]
            if len(p.tokens) > room:
                raise ConfigError(
                    f"the prompt of {p.where} is {len(p.tokens)} tokens, which leaves no room in data.seq_len="
                    f"{stream.seq_len} for rl.max_new_tokens={max_new_tokens}; raise data.seq_len to at least "
                    f"{len(p.tokens) + max_new_tokens}, lower rl.max_new_tokens, or shorten the prompt."
                )
