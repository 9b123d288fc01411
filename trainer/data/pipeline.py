"""Packed token batches from a prepared corpus, read with `tfds.data_source` and Grain.

Every row of a microbatch (global_batch_size / grad_accum_steps sequences) has
a document stream of its own: row r reads documents r, r+M, r+2M, ... of the
corpus (reshuffled each epoch from the seed)
and concatenates them into `seq_len` windows, splitting long documents across
windows. Segment ids mark the documents inside a window and positions restart
at each document. Because a row's contents depend only on its index, the
global batch is the same whatever the number of processes, and each process
opens only the streams of the rows its devices hold. A step reads as many
microbatches in a row as it accumulates. The iterator's state
(where every row's stream stands, keyed by row) goes into the checkpoint, so a
run can resume under another number of processes.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence

import grain
import jax
import numpy as np
import tensorflow_datasets as tfds
from grain.experimental import ConcatThenSplitIterDataset
from jax.sharding import NamedSharding

from trainer.data import text_files
from trainer.data.tokenizers import BOS_ID, EOS_ID, load_tokenizer
from trainer.errors import ConfigError

SYNTHETIC_DOCUMENTS = 2**62  # "infinite", yet a valid MapDataset length


def data_dir(data_cfg) -> str:
    return os.path.expanduser(data_cfg.data_dir or "~/tensorflow_datasets")


def prepare(data_cfg) -> None:
    """Build a text_files corpus if it is not on disk yet; other sources need nothing."""
    if data_cfg.source == "text_files":
        text_files.prepare(data_cfg.name, data_cfg.paths, data_dir(data_cfg))


def open_split(data_cfg, split: str):
    """A random-access source of examples (dicts) for one split."""
    name = f"text_files/{data_cfg.name}" if data_cfg.source == "text_files" else data_cfg.name
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir(data_cfg), download=False)
    except tfds.core.registered.DatasetNotFoundError as e:
        hint = (
            "run scripts/prepare_data.py with this config"
            if data_cfg.source == "text_files"
            else "prepare it with TFDS in array_record format"
        )
        raise ConfigError(f"dataset {name!r} is not prepared under {data_dir(data_cfg)}; {hint}.") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"dataset {name!r} has no split {split!r} ({e}).") from e


def check_vocab(cfg) -> None:
    if cfg.data.source == "synthetic":
        return
    size = load_tokenizer(cfg.data).vocab_size
    if size > cfg.model.vocab_size:
        raise ConfigError(
            f"the {cfg.data.tokenizer} tokenizer has {size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"raise model.vocab_size to at least {size} (a multiple of 128 shards best)."
        )


def _documents(cfg, split: str, shuffle: bool, endless: bool = True) -> grain.MapDataset:
    """A MapDataset of {"tokens": int32[n]} documents: endless, or the split once, in order."""
    seed = cfg.train.seed
    if cfg.data.source == "synthetic":
        # Uniform random tokens, one window per "document", fixed by seed and index.
        def random_doc(i):
            rng = np.random.default_rng([seed, i, split == cfg.data.eval_split])
            return {"tokens": rng.integers(3, cfg.model.vocab_size, cfg.data.seq_len, dtype=np.int32)}

        return grain.MapDataset.range(SYNTHETIC_DOCUMENTS).map(random_doc)

    docs = grain.MapDataset.source(open_split(cfg.data, split))
    if shuffle:
        docs = docs.shuffle(seed=seed)
    tokenizer, key = load_tokenizer(cfg.data), cfg.data.text_key

    def tokenize(example):
        ids = tokenizer.encode(example[key])
        return {"tokens": np.concatenate([[BOS_ID], ids, [EOS_ID]]).astype(np.int32)}

    if endless:
        docs = docs.repeat()  # repeat() reshuffles each epoch
    return docs.map(tokenize)


def _stack(rows) -> dict[str, np.ndarray]:
    return {
        "tokens": np.stack([r["tokens"] for r in rows]),
        "segment_ids": np.stack([r["tokens_segment_ids"] for r in rows]).astype(np.int32),
        "positions": np.stack([r["tokens_positions"] for r in rows]).astype(np.int32),
    }


def microbatch_size(cfg) -> int:
    """Sequences per microbatch: the unit the data streams deliver and a step accumulates."""
    return cfg.train.global_batch_size // cfg.train.grad_accum_steps


def batches(cfg, split: str, rows: Sequence[int], *, shuffle: bool) -> grain.IterDataset:
    """Endless microbatches holding the given rows (of `microbatch_size` rows), as numpy arrays.

    A training step takes several in a row (grad accumulation, or a batch-size
    ramp), so a larger batch means more microbatches, never other streams.
    """
    docs = _documents(cfg, split, shuffle)
    stride = microbatch_size(cfg)
    return _RowBatches(
        {
            r: ConcatThenSplitIterDataset(docs[r::stride].to_iter_dataset(), length_struct={"tokens": cfg.data.seq_len})
            for r in rows
        }
    )


class _RowBatches(grain.IterDataset):
    """Row streams read side by side into batches; the state is keyed by global row index,
    so a checkpoint written by one process layout restores under another."""

    def __init__(self, streams: dict[int, grain.IterDataset]):
        super().__init__(list(streams.values()))
        self._streams = streams

    def __iter__(self) -> grain.DatasetIterator:
        return _RowBatchesIterator({r: s.__iter__() for r, s in self._streams.items()})


class _RowBatchesIterator(grain.DatasetIterator):
    def __init__(self, streams: dict[int, grain.DatasetIterator]):
        super().__init__(list(streams.values()))
        self._streams = streams

    def __next__(self) -> dict[str, np.ndarray]:
        return _stack([next(s) for s in self._streams.values()])

    def get_state(self) -> dict:
        return {"rows": {str(r): s.get_state() for r, s in self._streams.items()}}

    def set_state(self, state: dict) -> None:
        saved = state["rows"]
        missing = [r for r in self._streams if str(r) not in saved]
        if missing:
            raise ConfigError(
                f"the checkpoint holds no data position for batch rows {missing[:4]}...; was it written with "
                "another train.global_batch_size?"
            )
        for r, stream in self._streams.items():
            stream.set_state(_slices_as_tuples(saved[str(r)]))


def _slices_as_tuples(state):
    """Grain 0.2.18's ConcatThenSplit tests `slice != (-1, -1)` to see if a document is
    half-read; a checkpoint's JSON turns the tuple into a list, the test then always
    says yes, and every restored row silently skips one document. Undo the JSON."""
    if isinstance(state, dict):
        return {
            k: {f: tuple(v) for f, v in val.items()} if k == "remainder_slices" else _slices_as_tuples(val)
            for k, val in state.items()
        }
    if isinstance(state, list):
        return [_slices_as_tuples(v) for v in state]
    return state


def one_pass(cfg, split: str, rows: Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """Every document of the split exactly once, in order, packed into windows dealt out to the rows.

    One stream packs the whole split, and window i goes to row i mod B, so the
    rows end together and only the last batch carries padding (segment id 0,
    no loss). Every process packs the same stream and keeps its own rows, so
    the batches do not depend on the number of processes; a held-out split is
    small enough for each process to read it whole.
    """
    if cfg.data.source == "synthetic":
        raise ConfigError("a synthetic source has no end; evaluate a fixed number of batches instead.")
    docs = _documents(cfg, split, shuffle=False, endless=False).to_iter_dataset()
    windows = iter(ConcatThenSplitIterDataset(docs, length_struct={"tokens": cfg.data.seq_len}))
    padding = {k: np.zeros(cfg.data.seq_len, np.int32) for k in ("tokens", "tokens_segment_ids", "tokens_positions")}
    size = microbatch_size(cfg)
    while True:
        batch = list(itertools.islice(windows, size))
        if not batch:
            return
        batch += [padding] * (size - len(batch))
        yield _stack([batch[r] for r in rows])


def process_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> list[int]:
    """The rows of the global batch that this process's devices hold, in order."""
    indices = sharding.addressable_devices_indices_map((global_batch, seq_len)).values()
    return sorted({r for idx in indices for r in range(*idx[0].indices(global_batch))})


def interleave(microbatches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """k microbatches as one batch whose row i*k + j is row i of microbatch j.

    The train step splits a batch into microbatches by stride (rows j, j+k, ...),
    so each device's contiguous block of rows holds a share of every microbatch
    and each microbatch stays spread over all data-parallel devices.
    """
    return {key: np.stack([m[key] for m in microbatches], axis=1).reshape(-1, *microbatches[0][key].shape[1:])
            for key in microbatches[0]}  # fmt: skip


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays laid out by `sharding`."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:])) for k, v in local.items()
    }
