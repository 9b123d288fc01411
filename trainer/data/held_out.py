"""Every document of a held-out split once, for a whole-split evaluation (trainer/evaluation/loss.py).

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

from trainer.config.errors import ConfigError
from trainer.data.streams import Stream, documents


def one_pass(stream: Stream, split: str, rows: Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """This process's part (`rows` of the global batch) of batches holding every document of the split once,
    then padding (segment 0) for ever. Each batch says whether this process's documents had `ended` before it:
    the caller stops at the first batch where they had on every process (trainer/evaluation/loss.py). A batch with
    nothing to predict is no end: a conversation's prompt can fill whole batches before its reply."""
    if stream.source == "synthetic":
        raise ConfigError("a synthetic source has no end; evaluate a fixed number of batches instead.")
    docs = documents(stream, split, shuffle=False, endless=False)
    fields = ("tokens", "loss_mask") if stream.format == "chat" else ("tokens",)
    windows = [_windows(({f: d[f] for f in fields} for d in docs[r :: stream.rows].to_iter_dataset()),
                        stream.seq_len) for r in rows]  # fmt: skip
    going, ended = np.zeros(len(rows), np.int32), np.ones(len(rows), np.int32)
    for batch in _packed(_across(windows), len(rows), stream.seq_len, fields):
        yield {**batch, "ended": going}
    while True:
        yield {**_Batch(len(rows), stream.seq_len, fields).arrays(), "ended": ended}


def _windows(documents: Iterator[dict], length: int) -> Iterator[list[tuple[dict, bool]]]:
    """A row's documents ({"tokens"}, and a conversation's "loss_mask") one after another, cut into windows of
    `length`: each window as its pieces, (the piece's arrays, whether it opens its document); the last window
    may be short."""
    window, used = [], 0
    for doc in documents:
        start, size = 0, len(doc["tokens"])
        while start < size:
            take = min(size - start, length - used)
            window.append(({f: a[start : start + take] for f, a in doc.items()}, start == 0))
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

    def __init__(self, rows: int, length: int, fields: tuple[str, ...] = ("tokens",)):
        self.fields = {f: np.zeros((rows, length), np.int32) for f in fields}
        self.segment_ids, self.positions = (np.zeros((rows, length), np.int32) for _ in range(2))
        self.used, self.segments, self.documents = np.zeros(rows, int), np.zeros(rows, int), np.zeros(rows, np.int32)
        self.length = length

    def place(self, piece: dict, opens: bool) -> bool:
        """Put a piece in the first row with room for all of it; False if none has."""
        size = len(piece["tokens"])
        room = np.flatnonzero(self.used + size <= self.length)
        if not len(room):
            return False
        row, start = room[0], self.used[room[0]]
        end = start + size
        self.segments[row] += 1
        for f, values in piece.items():
            self.fields[f][row, start:end] = values
        self.segment_ids[row, start:end] = self.segments[row]
        self.positions[row, start:end] = np.arange(size)
        self.used[row], self.documents[row] = end, self.documents[row] + opens
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        return {**self.fields, "segment_ids": self.segment_ids, "positions": self.positions,
                "documents": self.documents}  # fmt: skip


def _packed(pieces: Iterator[tuple[dict, bool]], rows: int, length: int,
            fields: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:  # fmt: skip
    batch = _Batch(rows, length, fields)
    for piece, opens in pieces:
        if not batch.place(piece, opens):
            yield batch.arrays()
            batch = _Batch(rows, length, fields)
            batch.place(piece, opens)
    if batch.used.any():
        yield batch.arrays()
