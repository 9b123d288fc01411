"""OLMo-core's and Dolma's token files, read as they are: `.npy` files that, despite the name, are bare
arrays of uint16 or uint32 token ids with no header (what `dolma tokens` writes and OLMo-core memory-maps),
documents one after another, each ending with the EOS id.

A file that np.save wrote (with its `\\x93NUMPY` header) is read as the array it holds, its dtype its own.
The user names the dtype (data.token_dtype) and the EOS id (data.eos_id; -1: the tokenizer's); documents
are cut after each EOS, as OLMo-core's `iter_document_indices` cuts them, and a last run of tokens with
no EOS after it is a document too. Finding the cuts reads each file once when it is opened, a chunk at a
time, checking every id against the vocabulary on the way.
"""

from __future__ import annotations

import os

import numpy as np

from trainer.config.errors import ConfigError
from trainer.data.readers.tokens import check_ids

DTYPES = ("uint16", "uint32")
NPY_MAGIC = b"\x93NUMPY"  # how a file np.save wrote begins
CHUNK = 16 * 2**20  # tokens scanned at once for the documents' ends


class DolmaFile:
    def __init__(self, path: str, dtype: str, eos_id: int, vocab_size: int):
        if dtype not in DTYPES:
            raise ConfigError(f"data.token_dtype={dtype!r} is not one of {', '.join(DTYPES)} (Dolma's token files).")
        self.tokens = _saved_array(path) if _is_saved_array(path) else _bare_tokens(path, dtype)
        ends = []
        for start in range(0, len(self.tokens), CHUNK):
            chunk = np.asarray(self.tokens[start : start + CHUNK])
            check_ids(chunk, vocab_size, path)
            ends.append(np.flatnonzero(chunk == eos_id) + start + 1)
        ends = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
        if len(self.tokens) and (not len(ends) or ends[-1] != len(self.tokens)):
            ends = np.append(ends, len(self.tokens))  # the tokens after the last EOS
        self._ends = ends
        self.documents = len(ends)

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self._ends[i - 1] if i else 0 : self._ends[i]])


def _is_saved_array(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(NPY_MAGIC)) == NPY_MAGIC


def _saved_array(path: str) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ConfigError(f"{path} begins as a NumPy file (np.save's header) but cannot be read as one ({e}).") from e
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise ConfigError(f"{path} is a NumPy file of {tokens.dtype}{list(tokens.shape)}; token files hold one "
                          "row of integer ids.")  # fmt: skip
    return tokens


def _bare_tokens(path: str, dtype: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise ConfigError(f"{path} is {size} bytes, not a whole number of {dtype} tokens ({itemsize} bytes each); "
                          "check data.token_dtype, or the file is cut short.")  # fmt: skip
    return np.memmap(path, dtype, "r") if size else np.zeros(0, dtype)
