"""Where a corpus is built and how it appears: staged apart, published whole, one builder at a time.

A build writes into a staging directory beside the corpus (a local disk), in a local temporary directory
(a bucket, prepared on this machine), or under a staging prefix in the bucket (a runner whose workers are
other machines). Publishing renames the staged dataset into place (a local disk: it appears whole at
once), or copies it with dataset_info.json last (a bucket: TFDS takes a directory without it for an
unprepared one). A build that fails leaves its staging directory removed and the corpus as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

from etils import epath

from trainer.data.preparation import shards, split
from trainer.storage.workdir import is_remote


@contextlib.contextmanager
def one_builder(data_dir: str, name: str, say: Callable[[str], None]):
    """Hold the corpus's build lock (a local disk; a bucket has none): a second process preparing the same
    corpus waits here until the first has finished or died, then finds the corpus prepared."""
    if is_remote(data_dir):
        yield
        return
    # Beside the machine's temporary files, not in data_dir: a refused build writes nothing there.
    key = hashlib.sha256(f"{os.path.abspath(data_dir)}\0{name}".encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"trainer-prepare-{key}.lock")
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another process is preparing {name}; waiting for it to finish ({path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def set_aside_unfinished(dirs: dict[str, epath.Path], say: Callable[[str], None]) -> None:
    """A local dataset directory a build left unfinished (no dataset_info.json, or a tokenised store without
    the record of its tokenizer: killed before it was written) is renamed aside, never deleted, to be built
    again."""
    for name, directory in dirs.items():
        if is_remote(str(directory)) or not directory.exists():
            continue
        info = (directory / "dataset_info.json").exists()
        tokens_unrecorded = name.endswith(shards.TOKENS_SUFFIX) and not (directory / split.TOKENIZER_FILE).exists()
        if info and not tokens_unrecorded:
            continue
        aside = f"{directory}.interrupted-{int(time.time())}"
        os.rename(directory, aside)
        say(f"the {'tokenised cache' if tokens_unrecorded else 'corpus'} {directory} was left unfinished; moved to "
            f"{aside}, preparing it again")  # fmt: skip


@contextlib.contextmanager
def staging(data_dir: str, name: str, in_bucket: bool):
    """A fresh directory to build in, removed afterwards whatever happens."""
    if not is_remote(data_dir):
        # Absolute: the walk up to the first folder that exists ends at '/', where a relative path's ends at
        # '' for ever (a relative data.data_dir not made yet hung here).
        where = os.path.join(os.path.abspath(data_dir), "text_files", f".{name}.building-{uuid.uuid4().hex[:8]}")
        made = where
        while not os.path.exists(os.path.dirname(made)):  # the first directory this build makes
            made = os.path.dirname(made)
        os.makedirs(where)

        def remove():
            shutil.rmtree(where, ignore_errors=True)
            for folder in _up_to(os.path.dirname(where), made):  # the folders made for it, if left empty
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
    elif in_bucket:
        import fsspec

        where = f"{data_dir}/text_files/.{name}.building-{uuid.uuid4().hex[:8]}"
        remove = lambda: fsspec.filesystem("gcs").rm(where, recursive=True)  # noqa: E731
    else:
        where = tempfile.mkdtemp(prefix="trainer-corpus-")
        remove = lambda: shutil.rmtree(where, ignore_errors=True)  # noqa: E731
    try:
        yield where
    finally:
        with contextlib.suppress(OSError):
            remove()


def _up_to(path: str, last: str):
    """`path` and its parents, up to and including `last` (none if `last` is not among them)."""
    chain = [path]
    while chain[-1] != last and os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return chain if chain[-1] == last else []


def publish(staged: str, target: str, name: str, lengths: dict[str, list[int]], sizes: dict[str, int],
            made_from: dict, made_with: dict | None, say: Callable[[str], None]) -> None:  # fmt: skip
    """Give the staged dataset its records and info, and put it in place (see the module's docstring)."""
    _write_json(f"{staged}/{split.MADE_FROM_FILE}", made_from)
    if made_with is not None:
        _write_json(f"{staged}/{split.TOKENIZER_FILE}", made_with)
    # The shards' names are relative: the info travels with them. A store's features follow its data.format.
    shards.write_info(name, staged, lengths, sizes, (made_with or {}).get("format", "text"))
    if not is_remote(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.rename(staged, target)
        except OSError:  # another builder, not held off by the lock (a disk shared between hosts), was first
            if not os.path.exists(f"{target}/dataset_info.json"):
                raise
            say(f"{target} was prepared by another process meanwhile; using it")
        return
    import fsspec

    fs = fsspec.filesystem("gcs")
    names = sorted((p.name for p in epath.Path(staged).iterdir()), key=lambda n: n == "dataset_info.json")
    for filename in names:  # dataset_info.json last: what makes the directory a prepared dataset
        if is_remote(staged):
            fs.copy(f"{staged}/{filename}", f"{target}/{filename}")
        else:
            fs.put_file(f"{staged}/{filename}", f"{target}/{filename}")
    fs.invalidate_cache()


def _write_json(path: str, value) -> None:
    epath.Path(path).write_text(json.dumps(value))
