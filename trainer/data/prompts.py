"""Reinforcement learning's prompts (data.format=prompts): a prepared corpus's rows as prompt tokens, the prompt
as the row gave it, and its answer, read by index.

A rollout batch takes the next `prompts` rows of the split, shuffled from the seed and reshuffled each epoch
as the training streams are (trainer/data/streams.py documents): batch k holds rows k * prompts onwards of
that endless order, so the batch is a function of k alone and resuming needs only the count of batches taken.
The rows are read from the text store (the answer lives there; a tokenised store holds the prompt's tokens
alone) and rendered through the chat template with the generation prompt, as a chat is continued.
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
    index: int  # its place in the split, for sentences that name it


def rows(stream, split: str, shuffle: bool) -> grain.MapDataset:
    """The split's rows as Prompts: endless and shuffled from the seed (training), or once in order."""
    stream = dataclasses.replace(stream, tokenized=False)
    source = readers.open_split(stream, stream.name, split)
    tokenizer = load_tokenizer(stream)
    template = chat.template_for(stream, tokenizer)
    docs = grain.MapDataset.range(len(source))
    if shuffle:
        docs = docs.shuffle(seed=stream.seed).repeat()

    def read(i):
        row = json.loads(source[int(i)]["text"])
        where = f"row {int(i) + 1} of the {split} split of {stream.name}"
        tokens = chat.prompt_ids(tokenizer, template, chat.prompt_messages(row["prompt"], where))
        return Prompt(tokens, row["prompt"], row["answer"], int(i))

    return docs.map(read)


def batch(rows: grain.MapDataset, k: int, size: int) -> list[Prompt]:
    """Rollout batch k: `size` prompts."""
    return [rows[k * size + j] for j in range(size)]


def check_room(rows: grain.MapDataset, count: int, seq_len: int, max_new_tokens: int) -> None:
    """Refuse a prompt that leaves fewer than `max_new_tokens` positions of data.seq_len, naming it; the
    split's first `count` rows are read (the whole split, where it is finite and no longer)."""
    room = seq_len - max_new_tokens
    for j in range(count):
        p = rows[j]
        if len(p.tokens) > room:
            raise ConfigError(
                f"row {p.index + 1}'s prompt is {len(p.tokens)} tokens, which leaves no room in data.seq_len={seq_len} "
                f"for rl.max_new_tokens={max_new_tokens}; raise data.seq_len to at least "
                f"{len(p.tokens) + max_new_tokens}, lower rl.max_new_tokens, or shorten the prompt."
            )
