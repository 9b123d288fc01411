"""A TFDS builder over local text or JSON-lines files, written to array_record.

Preparing needs no TensorFlow and no network. Each text file is one document;
each line of a .jsonl, .jsonl.gz or .jsonl.zst file is one document, and so is
each row of a .parquet file (its `data.text_key` field or column, default
`text`; checked in every Parquet file and every JSON-lines file's first line
before anything is built). Files are split
into train and validation by a hash of their path relative to the corpus
root, so the split is stable across machines and file orders.

The corpus lives at <data_dir>/text_files/<name>/1.0.0 and is read back with
`tfds.data_source("text_files/<name>")`, like any other prepared TFDS dataset.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig

import tensorflow_datasets as tfds

from trainer.errors import ConfigError

VALIDATION_PER_MILLE = 20  # 2% of files held out


def stdlib_patterns() -> list[str]:
    """This interpreter's standard-library sources: a corpus every machine has."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def list_files(patterns: list[str]) -> list[str]:
    files = sorted({f for p in patterns for f in glob.glob(os.path.expanduser(p), recursive=True) if os.path.isfile(f)})
    # The stdlib glob would also reach into installed packages.
    return [f for f in files if f"{os.sep}site-packages{os.sep}" not in f]


def is_validation(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < VALIDATION_PER_MILLE


class TextFiles(tfds.core.GeneratorBasedBuilder):
    """Local text/jsonl files as a TFDS dataset; the builder config name is the corpus name."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, splits: dict[str, list[tuple[str, str]]] | None = None, text_key: str = "text", **kwargs):
        self._splits = splits or {}  # split -> [(absolute path, path relative to the corpus root)]
        self._text_key = text_key
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({"text": tfds.features.Text(), "source": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(files) for split, files in self._splits.items()}

    def _generate_examples(self, files):
        key = self._text_key
        for path, rel in files:
            if path.endswith(".parquet"):
                for i, text in enumerate(_parquet_texts(path, key)):
                    yield f"{rel}:{i}", {"text": text, "source": rel}
            elif path.endswith(JSON_LINES):
                for i, line in enumerate(_lines(path)):
                    if line.strip():
                        yield f"{rel}:{i}", {"text": json.loads(line)[key], "source": rel}
            else:
                with open(path, "rb") as f:
                    yield rel, {"text": f.read().decode("utf-8", errors="replace"), "source": rel}


JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def _lines(path: str):
    """A JSON-lines file's lines, decompressed as its name says."""
    if path.endswith(".gz"):
        import gzip

        opened = gzip.open(path, "rt", encoding="utf-8", errors="replace")
    elif path.endswith(".zst"):
        import io

        import zstandard

        opened = io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8", errors="replace")
    else:
        opened = open(path, encoding="utf-8", errors="replace")
    with opened as f:
        yield from f


def _parquet_texts(path: str, key: str):
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(columns=[key], batch_size=1024):
        yield from (text or "" for text in batch.column(0).to_pylist())


def _check_text_key(path: str, key: str) -> None:
    """Refuse a file that lacks the text field, before anything is written."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
    elif path.endswith(JSON_LINES):
        first = next((line for line in _lines(path) if line.strip()), None)
        if first is None:
            return
        try:
            names = list(json.loads(first))
        except (json.JSONDecodeError, TypeError) as e:
            raise ConfigError(f"the first line of {path} is not a JSON object ({e}); fix or remove the file.") from e
    else:
        return
    if key not in names:
        raise ConfigError(
            f"{path} has no field {key!r} (it has {', '.join(names[:10])}); set data.text_key to the one "
            "holding the text."
        )


def prepare(name: str, paths: str, data_dir: str, text_key: str = "text") -> str:
    """Build the corpus `name` from comma-separated globs ("" = the stdlib) unless it exists."""
    patterns = [p.strip() for p in paths.split(",") if p.strip()] or stdlib_patterns()
    files = list_files(patterns)
    if not files:
        raise ConfigError(f"data.paths={paths!r} matches no files; give globs such as 'corpus/**/*.txt'.")
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    splits = {"train": [], "validation": []}
    for f in files:
        rel = os.path.relpath(f, root)
        splits["validation" if is_validation(rel) else "train"].append((f, rel))
    if not splits["train"] or not splits["validation"]:
        raise ConfigError(
            f"data.paths={paths!r} gives {len(files)} files, too few to hold out ~2% of them for "
            "validation; give more files (split a large file into several)."
        )
    builder = TextFiles(
        splits=splits,
        text_key=text_key,
        config=tfds.core.BuilderConfig(name=name, description=f"text files from {patterns}"),
        data_dir=data_dir,
        file_format="array_record",
    )
    if not builder.is_prepared():
        for f in files:
            _check_text_key(f, text_key)
        tfds.disable_progress_bar()  # TFDS still prints one line when done; its bars would bury the log
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder.data_dir
