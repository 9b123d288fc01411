"""Every document of a held-out split once, for a whole-split evaluation (trainer/evaluate.py).

What a token is predicted from is fixed by the rows of the global batch (B rows): row r takes documents
r, r+B, r+2B, ... of the split, in order, one after another, and cuts that stream into `seq_len` windows,
as a training row does; each piece of a document inside a window is a segment (positions restarting),
and attention never leaves it. So a piece is what a token sees, and the pieces are the same whatever
packs them.

Left in their rows, the pieces fill the batches badly: rows whose documents run out early are padding
while the long ones go on (11% of the slots held a predicted token on the quick-start split). Here a
process takes the pieces of its own rows, window by window across the rows, and packs them into its rows
of each batch, each into the first row with room (first fit), never cutting one: the same pieces, the
same figures, in far fewer batches.

Each process reads its own rows' documents only (1/processes of the split), so which batch a piece lands
in depends on how many processes share the rows, and the first K batches (eval.py --max_batches) with
it; the whole split's figures do not. A batch says how many documents begin in it (`documents`, per row,
which never reaches the device): a piece knows whether it opens its document, whatever the tokenizer's
marks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from trainer.data.streams import Stream, documents
from trainer.errors import ConfigError


def one_pass(stream: Stream, split: str, rows: Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """This process's part (`rows` of the global batch) of batches holding every document of the split once,
    then padding (segment 0) for ever: the caller stops at the first batch with nothing to predict on any
    process (trainer/evaluate.py), which every process reaches together."""
    if stream.source == "synthetic":
        raise ConfigError("a synthetic source has no end; evaluate a fixed number of batches instead.")
    docs = documents(stream, split, shuffle=False, endless=False)
    windows = [_windows((d["tokens"] for d in docs[r :: stream.rows].to_iter_dataset()), stream.seq_len)
               for r in rows]  # fmt: skip
    yield from _packed(_across(windows), len(rows), stream.seq_len)
    while True:
        yield _Batch(len(rows), stream.seq_len).arrays()


def _windows(documents: Iterator[np.ndarray], length: int) -> Iterator[list[tuple[np.ndarray, bool]]]:
    """A row's documents one after another, cut into windows of `length`: each window as its pieces, (tokens,
    whether the piece opens its document); the last window may be short."""
    window, used = [], 0
    for tokens in documents:
        start = 0
        while start < len(tokens):
            take = min(len(tokens) - start, length - used)
            window.append((tokens[start : start + take], start == 0))
            used, start = used + take, start + take
            if used == length:
                yield window
                window, used = [], 0
    if window:
        yield window


def _across(rows: list[Iterator[list]]) -> Iterator[tuple[np.ndarray, bool]]:
    """The pieces of every row's first window, then of every row's second, ...: the order the rows' own
    batches would have held them."""
    live = list(rows)
    while live:
        still = []
        for row in live:
            window = next(row, None)
            if window is not None:
                yield from window
                still.append(row)
        live = still


class _Batch:
    """One process's rows of a batch, filled piece by piece."""

    def __init__(self, rows: int, length: int):
        self.tokens, self.segment_ids, self.positions = (np.zeros((rows, length), np.int32) for _ in range(3))
        self.used, self.segments, self.documents = np.zeros(rows, int), np.zeros(rows, int), np.zeros(rows, np.int32)
        self.length = length

    def place(self, tokens: np.ndarray, opens: bool) -> bool:
        """Put a piece in the first row with room for all of it; False if none has."""
        room = np.flatnonzero(self.used + len(tokens) <= self.length)
        if not len(room):
            return False
        row, start = room[0], self.used[room[0]]
        end = start + len(tokens)
        self.segments[row] += 1
        self.tokens[row, start:end], self.segment_ids[row, start:end] = tokens, self.segments[row]
        self.positions[row, start:end] = np.arange(len(tokens))
        self.used[row], self.documents[row] = end, self.documents[row] + opens
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "segment_ids": self.segment_ids, "positions": self.positions,
                "documents": self.documents}  # fmt: skip


def _packed(pieces: Iterator[tuple[np.ndarray, bool]], rows: int, length: int) -> Iterator[dict[str, np.ndarray]]:
    batch = _Batch(rows, length)
    for tokens, opens in pieces:
        if not batch.place(tokens, opens):
            yield batch.arrays()
            batch = _Batch(rows, length)
            batch.place(tokens, opens)
    if batch.used.any():
        yield batch.arrays()
