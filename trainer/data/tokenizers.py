"""Byte-level, SentencePiece and Hugging Face tokenizers sharing one small interface.

Ours (byte, sentencepiece) reserve id 0 for padding, 1 for beginning- and 2 for
end-of-document. A Hugging Face `tokenizer.json` keeps its own ids: its
begin/end-of-text tokens become our begin/end of document.

A tokenizer file is read through etils.epath, so `data.tokenizer_path` may be a
local path or a `gs://` object: a run keeps its own copy in its run directory
(trainer/data/run_tokenizer.py), which every host reads. A tokenizer is known
by its kind and the digest of its file, not by where the file lies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from trainer.config.errors import ConfigError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int  # begins each document
    eos_id: int  # ends each document
    pad_id: int  # what an exported model pads with

    def encode(self, text: str | bytes) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for (0 for special ids): the denominator of bits per byte."""

    def encode_marked(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, the character offset each begins at) of a chat template's rendering, where the special
        tokens spelt in the text are those tokens (trainer/data/chat.py)."""


class ByteTokenizer:
    """UTF-8 bytes shifted past the three special ids: zero set-up, 259 symbols."""

    offset = 3
    vocab_size = 256 + offset
    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, np.uint8).astype(np.int32) + self.offset

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([0] * self.offset + [1] * 256)

    def encode_marked(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        return _marked(text, self._with_offsets)

    def _with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        widths = [len(c.encode("utf-8")) for c in text]
        return self.encode(text), np.repeat(np.arange(len(text)), widths)


class SentencePieceTokenizer:
    bos_id, eos_id, pad_id = BOS_ID, EOS_ID, PAD_ID

    def __init__(self, path: str):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=_path(path).read_bytes())
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

    def encode_marked(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        return _marked(text, self._with_offsets)

    def _with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        pieces = self._sp.encode(text, out_type="proto").pieces
        char_of_byte = np.repeat(np.arange(len(text) + 1), [len(c.encode("utf-8")) for c in text] + [1])
        ids = np.asarray([p.id for p in pieces], np.int32)
        return ids, char_of_byte[np.minimum([p.begin for p in pieces], len(char_of_byte) - 1)].astype(np.int64)


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


# Begin- and end-of-text token names, tried in this order where no tokenizer_config.json says (Llama 3,
# Llama 2 / Mistral, Gemma, GPT-2, whose one token does both).
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class HuggingFaceTokenizer:
    """A `tokenizer.json` through the `tokenizers` library; its special tokens are the document marks.

    The begin/end tokens come from a tokenizer_config.json beside the file
    (`bos_token`, `eos_token`), else from the first of BOS_NAMES / EOS_NAMES in
    its vocabulary. Documents are encoded without the tokenizer's own
    template: the stream adds the marks itself, once per document.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.file = file = tokenizer_file("hf", path)
        try:
            self._tok = Tokenizer.from_str(_path(file).read_text())
        except Exception as e:  # the library reports a bad file with a bare Exception
            raise ConfigError(
                f"data.tokenizer_path={path!r}: {file} does not load as a Hugging Face tokenizer.json ({e}); "
                "point it at a tokenizer.json or a directory holding one."
            ) from e
        # The ids' range, which an embedding must span: the library's vocabulary size is a count, and a file's
        # ids may have gaps (70000 the largest of 5 tokens).
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        named = _config_tokens(_path(file).parent)
        self.bos_id = self._special(named.get("bos_token"), BOS_NAMES, "begin", path)
        self.eos_id = self._special(named.get("eos_token"), EOS_NAMES, "end", path)
        self.pad_id = self.eos_id  # such files seldom have a padding token; nothing we train reads it
        pieces = [self._tok.id_to_token(i) or "" for i in range(self.vocab_size)]
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        # Byte-level vocabularies (GPT-2, Llama 3) spell each byte as one character; others spell text. A file
        # may have no decoder at all ("decoder": null); the library then joins pieces with spaces on decoding.
        byte_level = (json.loads(self._tok.to_str()).get("decoder") or {}).get("type") == "ByteLevel"
        self._bytes = np.array([
            0 if p in special else 1 if _BYTE_PIECE.fullmatch(p) else len(p) if byte_level
            else len(p.replace("\u2581", " ").encode("utf-8")) for p in pieces
        ])  # fmt: skip

    def _special(self, configured, names, which: str, path: str) -> int:
        for name in (configured, *names):
            if name is not None and self._tok.token_to_id(name) is not None:
                return self._tok.token_to_id(name)
        raise ConfigError(
            f"the tokenizer at data.tokenizer_path={path!r} has no {which}-of-text token (looked for "
            f"{configured or ', '.join(names)}); add one, or name it in a tokenizer_config.json beside it."
        )

    def encode(self, text: str | bytes) -> np.ndarray:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_marked(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        found = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(found.ids, np.int32), np.asarray([start for start, _ in found.offsets], np.int64)

    def piece(self, i: int) -> str:
        return self._tok.id_to_token(i)

    def token_bytes(self) -> np.ndarray:
        return self._bytes


def _marked(text: str, encode) -> tuple[np.ndarray, np.ndarray]:
    """Ours: the text between the marks encoded piece by piece (as transformers encodes the export's), each
    mark its id (chat.MARKS)."""
    from trainer.data.chat import MARKS

    ids, starts, at = [], [], 0
    for part in re.split(f"({'|'.join(map(re.escape, MARKS))})", text):
        if part in MARKS:
            ids.append(np.array([MARKS[part]], np.int32))
            starts.append(np.array([at]))
        elif part:
            piece_ids, piece_starts = encode(part)
            ids.append(piece_ids.astype(np.int32))
            starts.append(np.asarray(piece_starts, np.int64) + at)
        at += len(part)
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(starts)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # byte fallback pieces (Llama 2, Mistral)


def _config_tokens(directory) -> dict:
    """bos_token / eos_token from a tokenizer_config.json, as plain strings; {} without one."""
    path = directory / HF_CONFIG
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    out = {}
    for key in ("bos_token", "eos_token"):
        value = config.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


HF_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json: names its begin/end tokens


def _path(location: str):
    from etils import epath

    return epath.Path(location).expanduser()


def tokenizer_file(kind: str, location: str) -> str:
    """The file a tokenizer is read from: the path given, or a Hugging Face directory's tokenizer.json."""
    if kind == "hf" and _path(location).is_dir():
        return str(_path(location) / "tokenizer.json")
    return str(_path(location))


def load_tokenizer(data_cfg) -> Tokenizer:
    if data_cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = data_cfg.tokenizer_path
    if data_cfg.tokenizer == "hf":
        if importlib.util.find_spec("tokenizers") is None:
            raise ConfigError('data.tokenizer=hf needs the tokenizers library: pip install -e ".[hf]".')
        return HuggingFaceTokenizer(path)
    if not _path(path).exists():
        raise ConfigError(
            f"no SentencePiece model at data.tokenizer_path={path!r}; "
            "train one with scripts/train_tokenizer.py --config <your config>."
        )
    return SentencePieceTokenizer(path)


def digest(data_cfg) -> str:
    """The sha256 of the tokenizer's file ("" for the byte tokenizer, which has none): a file retrained
    under the same path makes other ids, and the same file anywhere makes the same ones."""
    import hashlib

    if data_cfg.tokenizer == "byte":
        return ""
    file = _path(tokenizer_file(data_cfg.tokenizer, data_cfg.tokenizer_path))
    if not file.exists():
        raise ConfigError(f"no tokenizer file at data.tokenizer_path={data_cfg.tokenizer_path!r}.")
    return hashlib.sha256(file.read_bytes()).hexdigest()


def made_with(data_cfg) -> dict:
    """What a tokenised cache records of its tokenizer: its kind, where it was read from, its digest; for
    conversations also their data.format and the digest of the chat template they were rendered with."""
    path = "" if data_cfg.tokenizer == "byte" else str(_path(data_cfg.tokenizer_path))
    record = {"tokenizer": data_cfg.tokenizer, "tokenizer_path": path, "sha256": digest(data_cfg)}
    format = getattr(data_cfg, "format", "text")
    if format != "text":
        import hashlib

        from trainer.data.chat import template_for

        source = template_for(data_cfg, load_tokenizer(data_cfg)).source
        record.update(format=format, chat_template=hashlib.sha256(source.encode()).hexdigest())
    return record


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two made_with records name the same tokenizer (and, for conversations, template): the path is
    where it was, not what it is."""
    keys = ("tokenizer", "sha256", "format", "chat_template")
    return [a.get(k) for k in keys] == [b.get(k) for k in keys]
