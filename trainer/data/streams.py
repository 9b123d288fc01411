"""Packed token batches from a prepared corpus, read with `tfds.data_source` and Grain.

Every row of the global batch (train.global_batch_size sequences) has a
document stream of its own: row r reads documents r, r+B, r+2B, ... of the
corpus (reshuffled each epoch from the seed) and concatenates them into
`seq_len` windows, splitting long documents across windows. Segment ids mark
the documents inside a window and positions restart at each document.

A step reads one window from every row: the global batch. Because a row's
contents depend only on its index, that batch is the same whatever the
number of processes, the mesh, or the number of microbatches the step splits
it into (gradient accumulation); each process opens only the streams of the
rows its devices hold. A batch-size ramp's smaller steps read every s-th row
(`ramp_rows`), which keeps each row on the process that owns it. The
iterator's state (where every row's stream stands, keyed by row) goes into the
checkpoint, so a run can resume under another number of processes, mesh or
accumulation.

A mixture (`data.mixture`: prepared corpora with weights) gives every row a
stream of its own from each corpus (each shuffled from the seed) and draws the
row's documents from them by weight, deterministically: the same documents in
the same order whatever the processes, and the same checkpointable row state.
With `data.mixture_unit=tokens` (the default) the weights are shares of tokens:
each row counts the tokens it has taken from each corpus and takes its next
document from the one furthest below its share (`row_iterators.TokenMix`, whose counts are
part of the row's state), so a corpus of long documents gets its weight's
share, not more. With `documents` (runs from before the unit existed) they
are shares of documents, drawn with Grain's `MapDataset.mix`. Each window then
also carries which corpus each of its tokens came from (`source`), for the
realised shares the loop logs (`mixture_counts`); it never reaches the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grain
import jax
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset, ThreadPrefetchDatasetIterator
from jax.sharding import NamedSharding

from trainer.config import stream_rows
from trainer.data import chat, readers, teacher_logits
from trainer.data.corpora import text_feature
from trainer.data.mixture import parse_mixture
from trainer.data.row_iterators import PairWindows, RowBatches, TokenMix
from trainer.data.tokenizers import load_tokenizer
from trainer.storage.workdir import is_remote

SYNTHETIC_DOCUMENTS = 2**62  # "infinite", yet a valid MapDataset length


@dataclasses.dataclass(frozen=True)
class Stream:
    """Everything the batches depend on. A checkpoint's data position means something only for the
    same stream, so a resume compares these fields (all but `data_dir`, which says where, not what)."""

    source: str
    name: str
    paths: str
    text_key: str
    tokenizer: str
    tokenizer_path: str
    seq_len: int
    packing: str
    train_split: str
    seed: int
    rows: int  # data.stream_rows (train.global_batch_size): one document stream per row
    vocab_size: int  # the synthetic source draws tokens below it
    mixture: tuple[tuple[str, float], ...] = ()  # (corpus, weight); () = `name` alone
    mixture_unit: str = "tokens"  # what the weights are shares of: "tokens" or "documents"
    tokenized: bool = False  # read the tokenised cache: the same ids, no tokenizer in the loop
    data_dir: str = ""
    # Token files read as they are (trainer/data/readers/): their split, and Dolma's dtype and end id.
    validation_fraction: float = 0.02
    token_dtype: str = "uint16"
    eos_id: int = -1
    # Post-training (trainer/data/chat.py): conversations rendered through `chat_template` ("" = the
    # tokenizer's own), trained on the tokens `loss_on` picks; preference pairs packed whole
    # (row_iterators.PairWindows).
    format: str = "text"
    loss_on: str = "all"
    chat_template: str = ""
    # Offline distillation: the folder of the teacher's logits for the training windows (trainer/data/
    # teacher_logits.py), read beside each row's tokens; "" = none.
    teacher_logits: str = ""

    @classmethod
    def from_config(cls, cfg, rows: int = 0) -> Stream:
        """The training stream, or with `rows` another number of rows (held-out batches: the global batch)."""
        d = cfg.data
        return cls(
            source=d.source, name=d.name, paths=d.paths, text_key=d.text_key, tokenizer=d.tokenizer,
            tokenizer_path=d.tokenizer_path, seq_len=d.seq_len, packing=d.packing, train_split=d.train_split,
            seed=cfg.train.seed, rows=rows or stream_rows(cfg), vocab_size=cfg.model.vocab_size,
            mixture=parse_mixture(d.mixture), mixture_unit=d.mixture_unit, tokenized=d.tokenized,
            data_dir=d.data_dir, validation_fraction=d.validation_fraction, token_dtype=d.token_dtype, eos_id=d.eos_id,
            format=d.format, loss_on=d.loss_on if d.format == "chat" else "all", chat_template=d.chat_template,
        )  # fmt: skip

    def with_teacher_logits(self, cfg) -> Stream:
        """The stream that also reads offline distillation's logits for its training windows, once they are
        known to be this run's (teacher_logits.check); itself without them."""
        if not (cfg.distill.teacher and cfg.distill.mode == "offline"):
            return self
        return dataclasses.replace(self, teacher_logits=teacher_logits.check(cfg, self.identity()))

    def sources(self) -> dict[str, Stream]:
        """Each corpus the stream reads, as a stream of its own: {name: stream} ({"": self} without a mixture)."""
        if not self.mixture:
            return {"": self}
        return {name: dataclasses.replace(self, name=name, mixture=()) for name, _ in self.mixture}

    def identity(self) -> dict:
        """What the batches depend on: not where the corpus or the tokenizer lives, nor whether its cache is
        read, nor the globs (and, for text files, the field) that selected its files: a prepared corpus records
        what it was made from and refuses a config that selects anything else (trainer/data/preparation/), so
        a glob spelt otherwise over the same files resumes; the tokenizer's file is held to the run's copy
        (trainer/data/run_tokenizer.py). The mixture's unit only where there is a mixture."""
        ignored = {"data_dir", "tokenized", "paths", "tokenizer_path", "chat_template", "teacher_logits"}
        ignored |= {"format", "loss_on"} if self.format == "text" else set()  # runs from before they existed
        ignored |= {"text_key"} if self.source == "text_files" else set()
        ignored |= set() if self.mixture else {"mixture_unit"}
        kinds = {readers.kind(self, c) for c in ([n for n, _ in self.mixture] or [self.name])}
        if kinds & {"megatron", "dolma"}:  # read as they are: the split and the documents' ends are the run's settings
            ignored -= {"paths"}
        else:  # a prepared corpus records its own split
            ignored |= {"validation_fraction", "token_dtype", "eos_id"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}


def documents(stream: Stream, split: str, shuffle: bool, endless: bool = True, tag: int | None = None):
    """A MapDataset of {"tokens": int32[n]} documents of `stream.name`: endless, or the split once, in
    order. With `tag`, each also has {"source": int32[n]} filled with it (its corpus in a mixture)."""
    seed = stream.seed
    if stream.source == "synthetic":
        # Uniform random tokens, one window per "document", fixed by seed and index.
        def random_doc(i):
            rng = np.random.default_rng([seed, i, split != stream.train_split])
            return {"tokens": rng.integers(3, stream.vocab_size, stream.seq_len, dtype=np.int32)}

        return grain.MapDataset.range(SYNTHETIC_DOCUMENTS).map(random_doc)

    docs = grain.MapDataset.source(readers.open_split(stream, stream.name, split))
    if shuffle:
        docs = docs.shuffle(seed=seed)
    if endless:
        docs = docs.repeat()  # repeat() reshuffles each epoch
    if stream.format != "text":
        return docs.map(_conversations(stream, tag))
    if readers.holds_tokens(stream, stream.name):
        return docs.map(lambda example: _tagged(np.asarray(example["tokens"], np.int32), tag))
    tokenizer, key = load_tokenizer(stream), text_feature(stream)

    def tokenize(example):
        ids = tokenizer.encode(example[key])
        return _tagged(np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int32), tag)

    return docs.map(tokenize)


def _conversations(stream: Stream, tag: int | None = None):
    """A prepared row -> its tokens and `loss_mask` (a conversation, tagged with its corpus in a mixture), or
    a preference pair's two sequences and the masks of their replies."""
    tokenizer = load_tokenizer(stream)
    template = chat.template_for(stream, tokenizer) if not stream.tokenized else None

    loss_on = "last_turn" if stream.format == "preference" else stream.loss_on  # DPO scores the replies alone

    def encoded(example):
        row = example if stream.tokenized else chat.encode(tokenizer, template, example["text"])
        out = {"tokens": np.asarray(row["tokens"], np.int32),
               "loss_mask": chat.loss_mask(np.asarray(row["turns"]), loss_on)}  # fmt: skip
        if stream.format == "preference":
            out["rejected"] = np.asarray(row["rejected"], np.int32)
            out["rejected_mask"] = chat.loss_mask(np.asarray(row["rejected_turns"]), "last_turn")
        return out if tag is None else {**out, "source": np.full_like(out["tokens"], tag)}

    return encoded


def _tagged(tokens: np.ndarray, tag: int | None) -> dict[str, np.ndarray]:
    return {"tokens": tokens} if tag is None else {"tokens": tokens, "source": np.full_like(tokens, tag)}


def _read_options(stream: Stream) -> grain.ReadOptions:
    """How each row reads its documents. From local files, in the reading thread: Grain's default read-ahead
    (16 threads and 500 documents for every row) made the quick start's first 4 held-out batches take 8 s, not
    0.06 s, and read 32 times slower after (benchmarks/RESULTS.md, restart and prepare); the batches are read
    ahead whole instead (prefetch). From a bucket, whose every read waits on the network, that read-ahead stays."""
    corpora = [n for n, _ in stream.mixture] or [stream.name]
    remote = is_remote(stream.data_dir) or any(is_remote(p) for c in corpora for p in readers.paths_of(stream, c)
                                               if readers.kind(stream, c) in ("megatron", "dolma"))  # fmt: skip
    return grain.ReadOptions() if remote else grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def batches(stream: Stream, split: str, rows: Sequence[int], *, shuffle: bool) -> grain.IterDataset:
    """Endless batches holding the given rows of the global batch, as numpy arrays.

    `next()` reads every row given here; `read(rows)` only some (a batch-size ramp's smaller steps).
    A mixture's batches also hold `source` (the corpus of each token: its index in data.mixture).
    """
    length = {"tokens": stream.seq_len}
    if stream.format == "preference":
        docs = documents(stream, split, shuffle)
        return RowBatches({r: PairWindows(docs[r :: stream.rows], stream.seq_len) for r in rows})
    if stream.format == "chat":
        length["loss_mask"] = stream.seq_len
    read = _read_options(stream)
    if not stream.mixture:
        docs = documents(stream, split, shuffle)
        row_docs = lambda r: docs[r :: stream.rows].to_iter_dataset(read)
    else:
        length["source"] = stream.seq_len
        drawn = [(i, weight) for i, (_, weight) in enumerate(stream.mixture) if weight > 0]
        sources = list(stream.sources().values())
        docs = {i: documents(sources[i], split, shuffle, tag=i) for i, _ in drawn}
        weights = [weight for _, weight in drawn]
        if stream.mixture_unit == "tokens":
            row_docs = lambda r: TokenMix([docs[i][r :: stream.rows] for i, _ in drawn], weights)
        else:
            row_docs = lambda r: grain.MapDataset.mix([docs[i][r :: stream.rows] for i, _ in drawn],
                                                      weights).to_iter_dataset(read)  # fmt: skip
    windows = {r: ConcatThenSplitIterDataset(row_docs(r), length_struct=length) for r in rows}
    if stream.teacher_logits and split == stream.train_split:
        windows = {r: teacher_logits.RowWithLogits(w, stream.teacher_logits, r) for r, w in windows.items()}
    return RowBatches(windows)


def mixture_counts(local: dict[str, np.ndarray], unit: str, corpora: int, bos_id: int) -> np.ndarray:
    """What each corpus gave a batch (this process's rows), in the mixture's unit: tokens trained on, or
    documents begun."""
    counted = document_starts(local, bos_id) if unit == "documents" else local["segment_ids"] > 0
    return np.bincount(local["source"][counted], minlength=corpora)


def document_starts(local: dict[str, np.ndarray], bos_id: int | None) -> np.ndarray:
    """Where documents begin in a batch, one place per document whatever the tokenizer's marks.

    Every segment starts at position 0, and only a window's first one can be a piece continued from the last
    window: any later one is a new document. The first is one if it opens with the BOS the loader puts before
    every document, unless it is a lone token ending at once, which is the last window's document's end mark
    (where BOS and EOS are one token, GPT-2's <|endoftext|>; a document has at least its two marks). With no
    tokenizer (the synthetic source, one window per document) each window's position 0 is one."""
    begins = (local["segment_ids"] > 0) & (local["positions"] == 0)
    if bos_id is None:
        return begins
    first = begins[:, 0] & (local["tokens"][:, 0] == bos_id)
    if begins.shape[1] > 1:
        first &= local["segment_ids"][:, 1] == local["segment_ids"][:, 0]
    return np.concatenate([first[:, None], begins[:, 1:]], axis=1)


def process_rows(sharding: NamedSharding, global_batch: int, seq_len: int) -> list[int]:
    """The rows of a batch of `global_batch` rows that this process's devices hold, in order."""
    indices = sharding.addressable_devices_indices_map((global_batch, seq_len)).values()
    return sorted({r for idx in indices for r in range(*idx[0].indices(global_batch))})


def ramp_rows(local_rows: Sequence[int], size: int, global_batch: int) -> list[int]:
    """The stream rows a smaller step of `size` rows reads: row a of its batch is row a x s of the
    global batch (s = global_batch / size). Each device holds the same contiguous share of any
    batch, so these rows belong to the process that reads them in a full step."""
    stride = global_batch // size
    return [a * stride for a in local_rows]


def step_rows(positions: Sequence[int], size: int, rows: int, read: int) -> list[int]:
    """The stream rows that a step of `size` sequences, `read` sequences into a stream of `rows` rows, reads at
    the batch positions `positions` (this process's), in order. A fraction (rows = s x size) reads every s-th
    row, from the (read / size mod s)-th on, so that s steps read each row once; a multiple (size = m x rows)
    reads m consecutive windows of each row side by side. Either way a process reads the rows it held in a
    batch of `rows` (its devices hold the same contiguous share of any batch)."""
    if size <= rows:
        s = rows // size
        return [a * s + (read // size) % s for a in positions]
    return [i // (size // rows) for i in positions]


def rows_read(positions: Sequence[int], size: int, rows: int) -> list[int]:
    """Every stream row that steps of `size` sequences read at `positions` (step_rows, over its turns)."""
    turns = max(rows // size, 1)
    return sorted({r for t in range(turns) for r in step_rows(positions, size, rows, t * size)})


# A mixture's corpus of each token; documents begun in a row, and whether a process's documents had ended
# (held_out.py).
HOST_ONLY = ("source", "documents", "ended")


def to_global(local: dict[str, np.ndarray], sharding: NamedSharding, global_batch: int) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays laid out by `sharding` (what the model does not read,
    HOST_ONLY, stays on the host)."""
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
        for k, v in local.items()
        if k not in HOST_ONLY
    }


class _Planned:
    """Each step's (rows in its batch, this process's part of it), read from a `batches()` iterator or
    ProcessRows as `plan(read)` says for the step that starts `read` sequences into the stream (a batch-size
    ramp reads a subset of the rows). Its state is the rows' state after the last batch it read."""

    def __init__(self, iterator, plan: Callable[[int], tuple[int, list[int]]], read: int):
        self._iterator, self._plan, self._read = iterator, plan, read

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, dict[str, np.ndarray]]:
        size, rows = self._plan(self._read)
        batch = self._iterator.read(rows)
        self._read += size
        return size, batch

    def get_state(self) -> dict:
        return self._iterator.get_state()

    def set_state(self, state: dict) -> None:
        self._iterator.set_state(state)


def prefetch(iterator, plan: Callable[[int], tuple[int, list[int]]], read: int, depth: int = 3):
    """The coming steps' batches (see _Planned), read `depth` steps ahead by Grain's thread prefetch, so that
    tokenising and packing overlap the device's step. Its `get_state()`, which the checkpoint asks, is the
    position after the last batch handed out, not after the batches read ahead; an error in the reading
    thread is raised by the `next()` that would have had its batch."""
    ahead = ThreadPrefetchDatasetIterator(_Planned(iterator, plan, read), prefetch_buffer_size=depth)
    ahead.start_prefetch()  # now, not at the first next(): the first batches are read while the step compiles
    return ahead
