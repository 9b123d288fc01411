"""Token files other stacks wrote, read as they are: what Megatron-LM's and Dolma's readers share.

A corpus of such files is read file by file, in path order, each file's documents in their order. It was
not prepared here, so it has no split of its own: of the corpus's documents, counted across its files in
that order, every K-th is held out, K = round(1 / data.validation_fraction) (the K-th, 2K-th, ...), so the
split holds the asked fraction whatever the files' sizes (a rule per file held out nothing of files of
fewer than K documents), and the two splits are read by index arithmetic, with nothing to build first.

Token ids are checked against model.vocab_size: at opening, over the first CHECKED_TOKENS of each file, and
then each document as it is read, so a corpus made with another tokenizer is said in one sentence.
"""

from __future__ import annotations

import bisect

import numpy as np

from trainer.config.errors import ConfigError

CHECKED_TOKENS = 64 * 2**20  # each file's first tokens checked against the vocabulary when it is opened


def every(fraction: float) -> int:
    """K: one document of every K held out."""
    return max(2, round(1 / fraction))


def split_count(documents: int, k: int, split: str) -> int:
    return documents // k if split == "validation" else documents - documents // k


def in_corpus(index: int, k: int, split: str) -> int:
    """The corpus's own index of a split's `index`-th document."""
    return index * k + k - 1 if split == "validation" else index + index // (k - 1)


def check_ids(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"{where} holds token id {int(tokens.max())}, at or above model.vocab_size={vocab_size}: the corpus was "
            "made with another tokenizer than this model's; raise model.vocab_size or give the corpus its tokenizer "
            "(data.tokenizer, data.tokenizer_path)."
        )


class Files:
    """One split of several token files read as one: file i contributes its split's documents in turn. Each
    file is an object with `documents` (its count) and `document(i)` (its i-th document's tokens)."""

    def __init__(self, files: list, split: str, fraction: float, vocab_size: int, names: list[str]):
        self._files, self._split, self._k, self._vocab, self._names = files, split, every(fraction), vocab_size, names
        self._starts = np.concatenate([[0], np.cumsum([f.documents for f in files])]).astype(np.int64)
        self._length = split_count(int(self._starts[-1]), self._k, split)
        if not self._length:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ConfigError(
                f"{shown} hold {int(self._starts[-1])} documents: holding out one of every {self._k} "
                f"(data.validation_fraction={fraction:g}) leaves the {split} split empty; "
                + ("raise data.validation_fraction, or give more documents." if split == "validation" else
                   "give more documents.")
            )  # fmt: skip

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        corpus = in_corpus(index, self._k, self._split)  # the document's place in the corpus
        f = bisect.bisect_right(self._starts, corpus) - 1
        position = corpus - int(self._starts[f])
        tokens = self._files[f].document(position)
        check_ids(tokens, self._vocab, f"document {position} of {self._names[f]}")
        return {"tokens": tokens.astype(np.int32)}
