"""Our tokenised store's documents: its flat token files where the store has them, else its records.

A text corpus's store (trainer/data/preparation/shards.py) holds, for each document, a tf.Example whose
`tokens` feature is the int32 ids' bytes, zlib-compressed (TFDS's Tensor with Encoding.ZLIB), in array_record
shards. Beside each shard, preparation also writes the shard's ids flat (`<shard>.ids`, FlatWriter), the
form Megatron's .bin and Dolma's .npy have: read by memory map, a document costs a slice and no
decompression or proto parsing (`FlatTokens`, ~1.7x the records' rate; benchmarks/prepare.py).

    <shard>.ids   the shard's documents' ids back to back (uint16 where every id written fits in 16 bits,
                  else int32; little-endian), then int64[documents + 1], each document's first id's place
                  and the end, then the footer: MAGIC, bytes per id (uint32), documents (uint64)

A store prepared before the flat files existed has none and is read from its records as before (`Tokens`:
TFDS's raw records via its own RAW_BYTES, parsed with TFDS's Example proto, the one field decompressed,
~60 us a document against TFDS's generic decoding's ~110 us). Both give the same documents in the same
order (tests/test_data.py compares each with TFDS's decoding), so a run resumes across the two.
"""

from __future__ import annotations

import array
import bisect
import json
import mmap
import os
import resource
import struct
import zlib

import numpy as np
from tensorflow_datasets.proto import tf_example_pb2

from trainer.config.errors import ConfigError

IDS = np.dtype("<i4")  # TFDS writes an int32 Tensor's bytes as numpy holds them: little-endian on our hosts
FLAT_SUFFIX = ".ids"
MAGIC = b"TRNIDS01"
FOOTER = struct.Struct("<8sIQ")  # MAGIC, bytes per id, documents
WIDTHS = {2: np.dtype("<u2"), 4: IDS}
FILES_BESIDE = 1024  # room left for what a process opens later (checkpoints, logs, other corpora's files)


class Tokens:
    """One split of a text corpus's tokenised store, from its records: `len()` and `[i]` -> {"tokens":
    int32[n] (read-only)}. (A document's `source`, its file, is TFDS's to decode: training never reads it.)"""

    def __init__(self, records):
        self._records = records  # tfds.data_source(..., deserialize_method=RAW_BYTES): the serialised Examples

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        features = tf_example_pb2.Example.FromString(self._records[index]).features.feature
        return {"tokens": np.frombuffer(zlib.decompress(features["tokens"].bytes_list.value[0]), IDS)}


class FlatWriter:
    """One shard's flat token file, written as the shard's documents are: uint16 ids while every id written fits
    16 bits, int32 from the first that does not (the file so far rewritten wider). The width follows the ids,
    not a vocabulary's count, which a tokenizer with gaps in its ids puts below its largest id."""

    def __init__(self, path: str):
        self.dtype = WIDTHS[2]
        self._file, self._ends = open(path, "w+b"), array.array("q", [0])  # noqa: SIM115

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high > np.iinfo(IDS).max:
                raise ConfigError(f"the tokenizer gave id {low if low < 0 else high}, which no token store holds "
                                  "(ids are 0 to 2^31 - 1); check data.tokenizer_path.")  # fmt: skip
            if high > np.iinfo(self.dtype).max:
                self._widen()
        self._file.write(ids.astype(self.dtype).tobytes())
        self._ends.append(self._ends[-1] + len(ids))

    def _widen(self) -> None:
        self._file.seek(0)
        written = np.frombuffer(self._file.read(), self.dtype)
        self._file.seek(0)
        self._file.truncate()
        self.dtype = WIDTHS[4]
        self._file.write(written.astype(self.dtype).tobytes())

    def close(self) -> None:
        self._file.write(np.frombuffer(self._ends, np.int64).astype("<i8").tobytes())
        self._file.write(FOOTER.pack(MAGIC, self.dtype.itemsize, len(self._ends) - 1))
        self._file.close()


def flat(directory: str, split: str, rebuild: str) -> FlatTokens | None:
    """One split of the store in `directory` (a local one) from its flat token files, or None where the store
    has none (prepared before them). `rebuild`: what to tell a user whose files are damaged."""
    try:
        with open(os.path.join(directory, "dataset_info.json")) as f:
            info = next(s for s in json.load(f)["splits"] if s["name"] == split)
    except (OSError, ValueError, StopIteration, KeyError):
        return None  # not prepared, or not ours: open_prepared says so
    lengths = [int(n) for n in info.get("shardLengths", [])]
    # The shards' names as TFDS's default template gives them (preparation/shards.py writes them by it).
    names = [f"text_files-{split}.array_record-{i:05d}-of-{len(lengths):05d}{FLAT_SUFFIX}" for i in range(len(lengths))]
    if not any(n.endswith(FLAT_SUFFIX) for n in os.listdir(directory)):
        return None
    present = [os.path.exists(os.path.join(directory, n)) for n in names]
    if not all(present):
        missing = names[present.index(False)]
        raise ConfigError(f"{directory} lacks {missing}, one of its flat token files; the store is damaged: {rebuild}")
    return FlatTokens([os.path.join(directory, n) for n in names], lengths, rebuild)


class FlatTokens:
    """One split of a store from its shards' flat token files: `len()` and `[i]` -> {"tokens": int32[n]}."""

    def __init__(self, paths: list[str], lengths: list[int], rebuild: str):
        _room_for(len(paths))
        self._ids, self._ends = [], []
        for path, documents in zip(paths, lengths, strict=True):
            ids, ends = _map(path, documents, rebuild)
            self._ids.append(ids)
            self._ends.append(ends)
        self._starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect.bisect_right(self._starts, index) - 1
        ends, j = self._ends[shard], index - self._starts[shard]
        return {"tokens": self._ids[shard][ends[j] : ends[j + 1]].astype(np.int32)}


def _room_for(maps: int) -> None:
    """Each mapped file holds a descriptor open (Python's mmap keeps a copy of it), and a large store has a shard
    per unit of its preparation, thousands: raise this process's soft limit on open files to fit them beside
    what it has open and FILES_BESIDE more, or say in one sentence that the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = _open_now() + maps + FILES_BESIDE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"the tokenised store has {maps} flat token files to map and this process may open only "
                          f"{hard} files (ulimit -Hn); raise that limit to at least {need}.")  # fmt: skip
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: no count to read
        return 0


def _map(path: str, documents: int, rebuild: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, ends) of one flat token file, mapped read-only, after checking its footer and size against the
    shard's count in dataset_info.json: a cut or foreign file is said here, not met as a wrong document."""
    size = os.path.getsize(path)
    damaged = f"{path} is damaged ({{}}): {rebuild}"
    if size < FOOTER.size:
        raise ConfigError(damaged.format(f"{size} bytes, shorter than its footer"))
    with open(path, "rb") as f:
        f.seek(size - FOOTER.size)
        magic, width, count = FOOTER.unpack(f.read(FOOTER.size))
        if magic != MAGIC or width not in WIDTHS or count != documents:
            raise ConfigError(damaged.format(f"its footer says {count} documents of {width}-byte ids with mark "
                                             f"{magic!r}; the shard holds {documents}"))  # fmt: skip
        whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tail = size - FOOTER.size - 8 * (count + 1)
    ends = np.frombuffer(whole, "<i8", count + 1, max(tail, 0)) if tail >= 0 else None
    if ends is None or ends[0] != 0 or ends[-1] * width != tail or np.any(np.diff(ends) < 0):
        raise ConfigError(damaged.format(f"{size} bytes do not hold the {count} documents its footer promises"))
    return np.frombuffer(whole, WIDTHS[width], int(ends[-1]), 0), ends
