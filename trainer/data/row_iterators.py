"""The Grain iterators a row's stream is made of, each with a state that goes into the checkpoint: a row's
documents drawn from several corpora by shares of tokens (`TokenMix`), DPO's pairs packed whole into windows
(`PairWindows`), and the rows of a batch read side by side, keyed by global row index (`RowBatches`).
trainer/data/streams.py builds them."""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from trainer.data import teacher_logits


def stack_windows(rows) -> dict[str, np.ndarray]:
    """Rows' windows (Grain's packed features) as one batch of the names the step reads."""
    batch = {
        "tokens": np.stack([r["tokens"] for r in rows]),
        "segment_ids": np.stack([r["tokens_segment_ids"] for r in rows]).astype(np.int32),
        "positions": np.stack([r["tokens_positions"] for r in rows]).astype(np.int32),
    }
    for key in ("source", "loss_mask"):
        if key in rows[0]:
            batch[key] = np.stack([r[key] for r in rows]).astype(np.int32)
    for key in teacher_logits.BATCH_KEYS:  # offline distillation's: (seq_len, top_k) a row
        if key in rows[0]:
            batch[key] = np.stack([r[key] for r in rows])
    return batch


class TokenMix(grain.IterDataset):
    """A row's documents drawn from several corpora (endless MapDatasets) so that each corpus's share of the
    tokens taken follows its weight: the next document comes from the corpus furthest below its share of the
    tokens taken so far (the first in data.mixture on a tie). The state is where each corpus's stream stands
    and the tokens taken from each, so a resume continues the same draw."""

    def __init__(self, parents: list[grain.MapDataset], weights: list[float]):
        super().__init__(parents)
        self._parents = parents
        self._shares = np.asarray(weights, np.float64) / sum(weights)

    def __iter__(self) -> TokenMixIterator:
        return TokenMixIterator(self._parents, self._shares)


class TokenMixIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.MapDataset], shares: np.ndarray):
        super().__init__()  # no parent iterators: `_parents` is Grain's name for those, which close() closes
        self._corpora, self._shares = parents, shares
        self._next = [0] * len(parents)
        self._taken = [0] * len(parents)

    def __next__(self) -> dict[str, np.ndarray]:
        behind = self._shares * sum(self._taken) - np.asarray(self._taken, np.float64)
        i = int(np.argmax(behind))
        doc = self._corpora[i][self._next[i]]
        self._next[i] += 1
        self._taken[i] += len(doc["tokens"])
        return doc

    def get_state(self) -> dict:
        return {"next": list(self._next), "taken": list(self._taken)}

    def set_state(self, state: dict) -> None:
        self._next, self._taken = [int(n) for n in state["next"]], [int(n) for n in state["taken"]]


class PairWindows(grain.IterDataset):
    """A row's preference pairs, whole, in windows of `seq_len`: each pair's prompt with the chosen reply is
    segment 2k+1 and with the rejected one 2k+2, as many pairs as fit, in order; the rest is padding. A pair
    longer than a window alone is cut to fit (each sequence keeps its start, the shorter whole if it fits
    in half). The state is the next pair's index."""

    def __init__(self, pairs: grain.MapDataset, seq_len: int):
        super().__init__()
        self._pairs, self._len = pairs, seq_len

    def __iter__(self) -> PairWindowsIterator:
        return PairWindowsIterator(self._pairs, self._len)


class PairWindowsIterator(grain.DatasetIterator):
    def __init__(self, pairs: grain.MapDataset, seq_len: int):
        super().__init__()
        self._pairs, self._len, self._next = pairs, seq_len, 0

    def __next__(self) -> dict[str, np.ndarray]:
        n = self._len
        out = {k: np.zeros(n, np.int32) for k in ("tokens", "tokens_segment_ids", "tokens_positions", "loss_mask")}
        at = segment = 0
        while True:
            pair = self._pairs[self._next]
            sides = [(pair["tokens"], pair["loss_mask"]), (pair["rejected"], pair["rejected_mask"])]
            lengths = [len(t) for t, _ in sides]
            if sum(lengths) > n:  # alone in its window, cut
                if segment:
                    break
                first = min(lengths[0], max(n // 2, n - lengths[1]))
                lengths = [first, min(lengths[1], n - first)]
            elif at + sum(lengths) > n:
                break
            for (tokens, mask), size in zip(sides, lengths, strict=True):
                segment += 1
                place = slice(at, at + size)
                out["tokens"][place], out["loss_mask"][place] = tokens[:size], mask[:size]
                out["tokens_segment_ids"][place], out["tokens_positions"][place] = segment, np.arange(size)
                at += size
            self._next += 1
            if at == n:
                break
        return out

    def get_state(self) -> dict:
        return {"next": self._next}

    def set_state(self, state: dict) -> None:
        self._next = int(state["next"])


class RowBatches(grain.IterDataset):
    """Row streams read side by side into batches; the state is keyed by global row index,
    so a checkpoint written by one process layout restores under another."""

    def __init__(self, streams: dict[int, grain.IterDataset]):
        super().__init__(list(streams.values()))
        self._streams = streams

    def __iter__(self) -> RowBatchesIterator:
        return RowBatchesIterator({r: s.__iter__() for r, s in self._streams.items()})


class RowBatchesIterator(grain.DatasetIterator):
    def __init__(self, streams: dict[int, grain.DatasetIterator]):
        super().__init__(list(streams.values()))
        self._streams = streams

    def __next__(self) -> dict[str, np.ndarray]:
        return self.read(self._streams)

    def read(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """The next window of each of `rows` (rows this iterator holds), stacked in that order."""
        return stack_windows([next(self._streams[r]) for r in rows])

    def get_state(self) -> dict:
        return {"rows": {str(r): s.get_state() for r, s in self._streams.items()}}

    def set_state(self, state: dict) -> None:
        saved = state["rows"]
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
