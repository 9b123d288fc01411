"""Megatron-LM's indexed datasets, read as they are: `<prefix>.bin` (the tokens, back to back) and
`<prefix>.idx`, as megatron-core's IndexedDatasetBuilder writes them:

    b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B,
    sequence count <Q, document count <Q (the documents' boundaries, a leading 0 included),
    sequence lengths int32[sequences], sequence pointers (bytes into .bin) int64[sequences],
    document indices int64[documents] (the first sequence of each document, then the count),
    then, in a multimodal dataset, each sequence's mode int8[sequences].

A document is its sequences' tokens, read by memory map.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from trainer.config.errors import ConfigError
from trainer.data.readers.tokens import CHECKED_TOKENS, check_ids

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


class MegatronFile:
    def __init__(self, prefix: str, vocab_size: int):
        index, data = f"{prefix}.idx", f"{prefix}.bin"
        for path in (index, data):
            if not os.path.isfile(path):
                raise ConfigError(f"{path} does not exist; data.paths names Megatron datasets by their prefix "
                                  "(the path without .bin or .idx).")  # fmt: skip
        with open(index, "rb") as f:
            head = f.read(len(HEADER) + 8 + 1 + 16)
        if len(head) < 34 or head[: len(HEADER)] != HEADER:
            raise ConfigError(f"{index} does not begin with Megatron's index header {HEADER!r}; it is not a "
                              "Megatron-LM .idx file (megatron-core's IndexedDatasetBuilder writes them).")  # fmt: skip
        version, code = struct.unpack("<QB", head[len(HEADER) : len(HEADER) + 9])
        sequences, documents = struct.unpack("<QQ", head[len(HEADER) + 9 :])
        if version != 1 or code not in DTYPES or not np.issubdtype(DTYPES[code], np.integer):
            raise ConfigError(f"{index} has version {version} and dtype code {code}; only version 1 with integer token "
                              f"ids ({', '.join(f'{c}: {t.__name__}' for c, t in DTYPES.items() if c < 6 or c == 8)}) "
                              "is read.")  # fmt: skip
        self.dtype = np.dtype(DTYPES[code])
        offset = len(head)
        expected = offset + 4 * sequences + 8 * sequences + 8 * documents
        size = os.path.getsize(index)
        if size not in (expected, expected + sequences):  # + the modes of a multimodal dataset
            raise ConfigError(f"{index} is {size} bytes, and its header promises {sequences} sequences and "
                              f"{documents} document boundaries ({expected} bytes); the file is cut short or "
                              "damaged.")  # fmt: skip
        lengths = np.memmap(index, np.int32, "r", offset, (sequences,))
        pointers = np.memmap(index, np.int64, "r", offset + 4 * sequences, (sequences,))
        bounds = np.array(np.memmap(index, np.int64, "r", offset + 12 * sequences, (documents,)))
        self.tokens = np.memmap(data, self.dtype, "r")
        if os.path.getsize(data) % self.dtype.itemsize:
            raise ConfigError(f"{data} is {os.path.getsize(data)} bytes, not a whole number of "
                              f"{self.dtype.name} tokens; the file is cut short or damaged.")  # fmt: skip
        starts = np.asarray(pointers) // self.dtype.itemsize
        # Token span of each document: from its first sequence's start to its last sequence's end (a document
        # of no sequence is empty).
        first, stop = bounds[:-1], bounds[1:]
        held = stop > first
        top = max(sequences - 1, 0)
        head, tail = np.clip(first, 0, top), np.clip(stop - 1, 0, top)
        self._begin = np.where(held, starts[head], 0) if sequences else np.zeros(len(first), np.int64)
        self._end = np.where(held, starts[tail] + lengths[tail], 0) if sequences else np.zeros(len(first), np.int64)
        if len(self._end) and self._end.max() > len(self.tokens):
            raise ConfigError(f"{index} points past the end of {data}; the two files do not belong together.")
        self.documents = len(first)
        check_ids(np.asarray(self.tokens[:CHECKED_TOKENS]), vocab_size, data)

    def document(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self._begin[i] : self._end[i]])
