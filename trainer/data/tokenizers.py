"""Byte-level and SentencePiece tokenizers sharing one small interface.

Both reserve id 0 for padding, 1 for beginning- and 2 for end-of-document.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from trainer.errors import ConfigError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special ids): the denominator of bits per byte."""


class ByteTokenizer:
    """UTF-8 bytes shifted past the three special ids: zero set-up, 259 symbols."""

    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, np.uint8).astype(np.int32) + self.offset

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([0] * self.offset + [1] * 256)


class SentencePieceTokenizer:
    def __init__(self, path: str):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str | bytes) -> np.ndarray:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        sp, sizes = self._sp, []
        for i in range(self.vocab_size):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i):
                sizes.append(0)
            elif sp.is_byte(i):
                sizes.append(1)  # <0xNN>
            else:
                sizes.append(len(piece.replace("\u2581", " ").encode("utf-8")))
        return np.array(sizes)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, path: str) -> None:
    """Train a BPE model on `texts` and write it to `path` (a .model file).

    Settings suit code as well as prose: whitespace is kept as written, digits
    are split, and unseen bytes fall back to byte pieces instead of <unk>.
    """
    import sentencepiece as spm

    if not path.endswith(".model"):
        raise ConfigError(f"the tokenizer path {path!r} must end in .model.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_prefix=path[: -len(".model")],
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=3,
        byte_fallback=True,
        split_digits=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        user_defined_symbols=["\n", "\t"],
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        minloglevel=2,
    )


def load_tokenizer(data_cfg) -> Tokenizer:
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(data_cfg.tokenizer_path)
    if not os.path.exists(path):
        raise ConfigError(
            f"no SentencePiece model at data.tokenizer_path={path!r}; "
            "train one with scripts/train_tokenizer.py --config <your config>."
        )
    return SentencePieceTokenizer(path)


def identity(data_cfg) -> tuple[str, str]:
    """What decides which ids a text becomes: the settings load_tokenizer reads."""
    return data_cfg.tokenizer, data_cfg.tokenizer_path if data_cfg.tokenizer != "byte" else ""
