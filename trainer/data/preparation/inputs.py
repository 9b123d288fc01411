"""The files a corpus is prepared from, and the documents in them.

A text file is one document; each line of a .jsonl, .jsonl.gz or .jsonl.zst file is one, and so is each
row of a .parquet file (its `data.text_key` field or column). Each file has two names below a root:
`place`, its path below its own glob's root (the glob's directories before its first wildcard), which
the split hashes (trainer/data/preparation/split.py) so that a document keeps its side whatever other
globs join the corpus; and `common`, its path below the common root of all the files, which corpora
prepared before places were per glob hashed, and keep hashing.

Files are read once, streaming: a line or a Parquet batch at a time, never a whole file.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import sysconfig
from collections.abc import Iterator

from trainer.config.errors import ConfigError
from trainer.data.chat import row_text

JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_ROWS = 64  # rows decoded at once from a Parquet row group: a bounded number of documents in memory


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    place: str  # below its own glob's root
    common: str  # below the common root of every file of the corpus
    size: int

    @property
    def one_document(self) -> bool:
        return not (self.path.endswith(".parquet") or self.path.endswith(JSON_LINES))


def stdlib_patterns() -> list[str]:
    """This interpreter's standard-library sources: a corpus every machine has."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def glob_root(pattern: str) -> str:
    """The directories of a glob before its first wildcard ('/data/web/*.jsonl' -> '/data/web'; a glob
    without one: its file's directory)."""
    parts = os.path.expanduser(pattern).split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or os.sep


def list_files(patterns: list[str]) -> list[InputFile]:
    """The files the globs select, in path order; each takes its place below the first glob that selects it.
    The stdlib glob's reach into installed packages is left out."""
    root_of: dict[str, str] = {}
    for pattern in patterns:
        root = glob_root(pattern)
        for f in glob.glob(os.path.expanduser(pattern), recursive=True):
            if os.path.isfile(f) and f"{os.sep}site-packages{os.sep}" not in f:
                root_of.setdefault(os.path.abspath(f), os.path.abspath(root))
    paths = sorted(root_of)
    if not paths:
        return []
    common = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [InputFile(p, os.path.relpath(p, root_of[p]), os.path.relpath(p, common), os.path.getsize(p)) for p in paths]


def documents(file: InputFile, text_key: str, format: str = "text",
              loss_on: str = "all") -> Iterator[tuple[int | None, str, int]]:  # fmt: skip
    """(index, text, input bytes read so far) of each document of `file`, in order: its row or line (None
    for a file that is one document); blank JSON lines are skipped and keep their index. A row of a chat or
    preference corpus (data.format) is its canonical JSON (trainer/data/chat.py), checked."""
    path = file.path
    if format != "text":
        rows = _rows(file)
        for i, row, read in rows:
            yield i, row_text(row, format, loss_on, f"row {i + 1} of {path}" if path.endswith(".parquet")
                              else f"line {i + 1} of {path}"), read  # fmt: skip
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        rows, i = max(table.metadata.num_rows, 1), 0
        for batch in table.iter_batches(columns=[text_key], batch_size=PARQUET_ROWS):
            for text in batch.column(0).to_pylist():
                yield i, text or "", file.size * (i + 1) // rows
                i += 1
    elif path.endswith(JSON_LINES):
        raw, lines = _opened(path)
        with raw, lines:
            for i, line in enumerate(lines):
                if line.strip():
                    yield i, _field(line, text_key, path, i + 1), raw.tell()
    else:
        with open(path, "rb") as f:
            yield None, f.read().decode("utf-8", errors="replace"), file.size


def _rows(file: InputFile) -> Iterator[tuple[int, object, int]]:
    """(index, the row as Python objects, input bytes read so far) of each row of a .parquet or JSON-lines
    file; a line that is not JSON is named."""
    path = file.path
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        count, i = max(table.metadata.num_rows, 1), 0
        for batch in table.iter_batches(batch_size=PARQUET_ROWS):
            for row in batch.to_pylist():
                yield i, row, file.size * (i + 1) // count
                i += 1
        return
    raw, lines = _opened(path)
    with raw, lines:
        for i, line in enumerate(lines):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"line {i + 1} of {path} is not JSON ({_where(e)}); fix or remove that "
                                      "line.") from e  # fmt: skip
                yield i, row, raw.tell()


def _opened(path: str):
    """(the raw file, its lines decompressed as its name says): the raw file's position is the input read."""
    raw = open(path, "rb")  # noqa: SIM115 - closed by the caller, with the lines over it
    if path.endswith(".gz"):
        import gzip

        stream = gzip.GzipFile(fileobj=raw)
    elif path.endswith(".zst"):
        import zstandard

        stream = zstandard.ZstdDecompressor().stream_reader(raw)
    else:
        stream = raw
    return raw, io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


def _where(error: json.JSONDecodeError) -> str:
    """The parser's complaint, placed by column: its own 'line 1' is a line of the one line it was given."""
    return f"{error.msg} at column {error.colno}"


def _field(line: str, key: str, path: str, number: int) -> str:
    """A JSON line's text field, or one sentence naming the file and line that lack it."""
    try:
        return json.loads(line)[key]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        what = "is not a JSON object" if isinstance(e, json.JSONDecodeError) else f"has no field {key!r}"
        raise ConfigError(
            f"line {number} of {path} {what}; fix or remove that line, or set data.text_key to the field holding "
            "the text."
        ) from e


def check_text_key(path: str, key: str, format: str = "text") -> None:
    """Refuse a file that lacks the text field (by its schema, or its first JSON line), before anything is
    written; a chat or preference corpus is made of rows."""
    if format != "text":
        if not path.endswith((".parquet", *JSON_LINES)):
            raise ConfigError(
                f"{path} is not .jsonl or .parquet; a {format} corpus (data.format) is made of rows of those."
            )
        return
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
    elif path.endswith(JSON_LINES):
        raw, lines = _opened(path)
        with raw, lines:
            first = next((line for line in lines if line.strip()), None)
        if first is None:
            return
        try:
            names = list(json.loads(first))
        except (json.JSONDecodeError, TypeError) as e:
            why = _where(e) if isinstance(e, json.JSONDecodeError) else "not an object"
            raise ConfigError(f"the first line of {path} is not a JSON object ({why}); fix or remove the file.") from e
    else:
        return
    if key not in names:
        raise ConfigError(
            f"{path} has no field {key!r} (it has {', '.join(names[:10])}); set data.text_key to the one "
            "holding the text."
        )
