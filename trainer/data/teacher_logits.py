"""A teacher's top-k logits stored beside a prepared corpus, for offline distillation (distill.mode=offline,
trainer/objectives/distill.py): written once by scripts/teacher_logits.py, read by training in step with the
tokens.

Every row of the global batch reads its own document stream (trainer/data/streams.py), so the windows a run
trains on are fixed by the corpus, the seed, the batch and the sequence length: row r's w-th window is the
same whatever the mesh, the processes or a resume. The teacher scores each window as the step would (its
documents apart, as packed), and each position keeps the teacher's `top_k` largest logits: their ids (int32)
and values (float32, as the teacher computed them; the temperature is applied when training), 8 x top_k
bytes a token. Row r's windows go to rows/<r>.ids.npy and rows/<r>.logits.npy, (windows, seq_len, top_k)
each, streamed to disk a few windows at a time under a temporary name and renamed when whole, so memory
stays flat however long the run, an interrupted run of the script keeps the rows it finished and the windows
of a row it had begun, and a second run writes the rest. manifest.json says what they were made for: the stream's
identity, the rows, the sequence length, top_k, the teacher (DIR@STEP) and the windows (train.steps);
training refuses logits made for anything else, in one sentence.

A row's logits are read as another stream beside its tokens: the w-th window's logits with its w-th window,
and the position in them is part of the row's checkpointed state.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import grain
import numpy as np

from trainer.config.errors import ConfigError

MANIFEST = "manifest.json"
ROWS = "rows"
BATCH_KEYS = ("teacher_ids", "teacher_logits")  # what a batch carries of them: (batch, seq, top_k) each


def location(cfg, stream_identity: dict) -> str:
    """distill.logits_dir, or beside the prepared corpus: <data_dir>/teacher_logits/<corpus>-<digest of what
    the logits depend on> (not the steps: a shorter run reads the first windows of a longer one's)."""
    if cfg.distill.logits_dir:
        return cfg.distill.logits_dir
    made_for = json.dumps({k: v for k, v in manifest(cfg, stream_identity).items() if k != "windows"},
                          sort_keys=True)  # fmt: skip
    root = cfg.data.data_dir or os.path.expanduser("~/tensorflow_datasets")
    return os.path.join(root, "teacher_logits", f"{cfg.data.name}-{hashlib.sha256(made_for.encode()).hexdigest()[:12]}")


def manifest(cfg, stream_identity: dict) -> dict:
    """What a run's logits are made for (cfg's distill.teacher pinned as DIR@STEP), as its JSON reads back."""
    made_for = {"stream": stream_identity, "rows": cfg.train.global_batch_size, "seq_len": cfg.data.seq_len,
                "top_k": cfg.distill.top_k, "teacher": cfg.distill.teacher, "windows": cfg.train.steps}  # fmt: skip
    return json.loads(json.dumps(made_for))


def _files(folder: str, row: int) -> tuple[str, str]:
    return tuple(os.path.join(folder, ROWS, f"{row}.{kind}.npy") for kind in ("ids", "logits"))


def missing_rows(folder: str, rows: int) -> list[int]:
    return [r for r in range(rows) if not all(os.path.exists(f) for f in _files(folder, r))]


def check(cfg, stream_identity: dict) -> str:
    """The logits' folder for this run, once it holds logits made for it; else one sentence naming what
    differs, or what to run."""
    folder, wanted = location(cfg, stream_identity), manifest(cfg, stream_identity)
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        # Beside the corpus, each set of logits has a folder of its own: the nearest one made for this corpus
        # is named, with what it was made for.
        nearest = None if cfg.distill.logits_dir else _nearest(os.path.dirname(folder), cfg.data.name, wanted)
        if nearest is None:
            raise ConfigError(f"distill.mode=offline: no teacher logits at {folder}; write them first with "
                              "scripts/teacher_logits.py and this config.")  # fmt: skip
        folder, differ = nearest
        path = os.path.join(folder, MANIFEST)
    else:
        with open(path) as f:
            differ = _differences(json.load(f), wanted)
    if differ:
        raise ConfigError(f"the teacher logits at {folder} were made for {'; '.join(differ)}; write this run's "
                          "with scripts/teacher_logits.py.")  # fmt: skip
    with open(path) as f:
        made = json.load(f)
    if made["windows"] < wanted["windows"]:
        raise ConfigError(f"the teacher logits at {folder} cover {made['windows']} steps, and train.steps is "
                          f"{wanted['windows']}; write them for this many steps.")  # fmt: skip
    unfinished = missing_rows(folder, wanted["rows"])
    if unfinished:
        raise ConfigError(f"the teacher logits at {folder} lack {len(unfinished)} of {wanted['rows']} rows (rows "
                          f"{unfinished[:4]}...): run scripts/teacher_logits.py again to finish them.")  # fmt: skip
    return folder


# What each field of a manifest differs by, in words.
MADE_FOR = {
    "stream": "another corpus or batch (data.*, train.seed)",
    "rows": "another train.global_batch_size",
    "seq_len": "another data.seq_len",
    "top_k": "another distill.top_k",
    "teacher": "another teacher",
}


def _differences(made: dict, wanted: dict) -> list[str]:
    return [f"{MADE_FOR[k]} ({made.get(k)!r} there, {wanted[k]!r} here)" if k != "stream" else MADE_FOR[k]
            for k in MADE_FOR if made.get(k) != wanted[k]]  # fmt: skip


def _nearest(root: str, corpus: str, wanted: dict) -> tuple[str, list[str]] | None:
    """(the folder under `root` of logits made for `corpus` that differ from `wanted` in the fewest fields, those
    differences), or None where there is none."""
    found = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, MANIFEST)
        if name.startswith(f"{corpus}-") and os.path.exists(path):
            with open(path) as f:
                differ = _differences(json.load(f), wanted)
            found.append((len(differ), os.path.join(root, name), differ))
    return min(found)[1:] if found else None


class RowWithLogits(grain.IterDataset):
    """A row's windows (its tokens' stream) each with the row's stored logits for it."""

    def __init__(self, windows: grain.IterDataset, folder: str, row: int):
        super().__init__([windows])
        self._windows, self._folder, self._row = windows, folder, row

    def __iter__(self):
        return _RowWithLogitsIterator(self._windows.__iter__(), self._folder, self._row)


class _RowWithLogitsIterator(grain.DatasetIterator):
    def __init__(self, windows, folder: str, row: int):
        super().__init__([windows])
        self._windows, self._next = windows, 0
        self._ids, self._logits = (np.load(f, mmap_mode="r") for f in _files(folder, row))

    def __next__(self) -> dict[str, np.ndarray]:
        window = next(self._windows)
        if self._next >= self._ids.shape[0]:
            raise ConfigError(f"the teacher logits end after {self._ids.shape[0]} windows a row; write them for "
                              "as many steps as the run trains.")  # fmt: skip
        w, self._next = self._next, self._next + 1
        return {**window, "teacher_ids": np.asarray(self._ids[w]), "teacher_logits": np.asarray(self._logits[w])}

    def get_state(self) -> dict:
        return {"windows": self._windows.get_state(), "logits": self._next}

    def set_state(self, state: dict) -> None:
        self._windows.set_state(state["windows"])
        self._next = int(state["logits"])


WINDOW_KEYS = ("tokens", "positions", "segment_ids")  # what the teacher scores of a window
PART, WRITTEN = ".part.npy", "written"  # a row being written: its files, and how many windows they hold


def write_row(row: int, folder: str, windows, count: int, score, batch: int = 8) -> None:
    """Row `row`'s logits of its first `count` windows, streamed: `windows` (the row's stream: {tokens,
    positions, segment_ids}, (1, seq_len) each) is read `batch` windows at a time, `score(tokens, positions,
    segment_ids)` gives their top k (ids, values), and each batch is written into the row's .npy files at its
    place as it comes, so memory holds one batch whatever the run's length (written through the file, not a
    memory map, whose pages would count against the process). The files grow under a temporary name beside a
    count of the windows they hold; a row part-written goes on after its last whole batch (the windows before
    it read again, not scored), and is renamed into place when whole."""
    ids_file, logits_file = _files(folder, row)
    parts = [ids_file + PART, logits_file + PART]
    mark = os.path.join(folder, ROWS, f"{row}.{WRITTEN}")
    done = 0
    if os.path.exists(mark) and all(os.path.exists(p) for p in parts):
        with open(mark) as f:
            done = int(f.read())
    files = [open(p, "r+b") for p in parts] if done else None
    try:
        for start in range(0, count, batch):
            chunk = [next(windows) for _ in range(min(batch, count - start))]
            if start + len(chunk) <= done:
                continue  # scored by the interrupted writing
            scored = [np.asarray(x) for x in score(*(np.concatenate([w[k] for w in chunk]) for k in WINDOW_KEYS))]
            if files is None:
                files = [open(p, "w+b") for p in parts]
                for f, a in zip(files, scored, strict=True):
                    header = {"descr": np.lib.format.dtype_to_descr(a.dtype), "fortran_order": False,
                              "shape": (count, *a.shape[1:])}  # fmt: skip
                    np.lib.format.write_array_header_1_0(f, header)
            for f, a in zip(files, scored, strict=True):
                f.seek(0)
                np.lib.format.read_magic(f)
                np.lib.format.read_array_header_1_0(f)  # leaves the file at the first element
                f.seek(f.tell() + start * a[0].nbytes)
                f.write(np.ascontiguousarray(a).tobytes())
                f.flush()
                os.fsync(f.fileno())
            with open(mark + ".tmp", "w") as f:  # the count moves only once the windows it counts are on disk
                f.write(str(start + len(chunk)))
            os.replace(mark + ".tmp", mark)
    finally:
        for f in files or []:
            f.close()
    for part, file in zip(parts, (ids_file, logits_file), strict=True):
        os.replace(part, file)
    os.remove(mark)


class Progress(threading.Thread):
    """Says every `every` seconds how many of the rows are written, their bytes and the time left."""

    def __init__(self, folder: str, rows: int, say, every: float = 30.0):
        super().__init__(name="trainer-teacher-logits-progress", daemon=True)
        self._folder, self._rows, self._say, self._every = folder, rows, say, every
        self._done, self._began, self._start = (
            threading.Event(),
            time.monotonic(),
            rows - len(missing_rows(folder, rows)),
        )

    def run(self) -> None:
        while not self._done.wait(self._every):
            self._say(self.line())

    def line(self) -> str:
        done = self._rows - len(missing_rows(self._folder, self._rows))
        written = sum(os.path.getsize(f) for r in range(self._rows) for f in _files(self._folder, r)
                      if os.path.exists(f))  # fmt: skip
        rate = (done - self._start) / max(time.monotonic() - self._began, 1e-9)
        left = f", {(self._rows - done) / rate:.0f}s left" if rate > 0 and done < self._rows else ""
        return f"teacher logits: {done}/{self._rows} rows, {written / 2**20:.1f} MiB{left}"

    def stop(self) -> None:
        self._done.set()
