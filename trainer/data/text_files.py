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

Its tokenised cache (`data.tokenized`, or `scripts/prepare_data.py --tokenize`)
is the same builder over the same files, holding each document's token ids
(begin and end marks included) instead of its text, as `text_files/<name>-tokens`;
the tokenizer it was made with is written beside it (TOKENIZER_FILE), and a
config with another one is refused.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig

import numpy as np
import tensorflow_datasets as tfds

from trainer.errors import ConfigError

VALIDATION_PER_MILLE = 20  # 2% of files held out
TOKENS_SUFFIX = "-tokens"  # the tokenised cache of corpus <name> is corpus <name>-tokens
TOKENIZER_FILE = "made_with_tokenizer.json"


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

    def __init__(self, *, splits: dict[str, list[tuple[str, str]]] | None = None, text_key: str = "text",
                 tokenizer=None, **kwargs):  # fmt: skip
        """With `tokenizer`, documents are stored as token ids (the tokenised cache) instead of text."""
        self._splits = splits or {}  # split -> [(absolute path, path relative to the corpus root)]
        self._text_key = text_key
        self._tokenizer = tokenizer
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        if self.builder_config.name.endswith(TOKENS_SUFFIX):
            content = tfds.features.Tensor(shape=(None,), dtype=np.int32, encoding=tfds.features.Encoding.ZLIB)
            features = tfds.features.FeaturesDict({"tokens": content, "source": tfds.features.Text()})
        else:
            features = tfds.features.FeaturesDict({"text": tfds.features.Text(), "source": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(files) for split, files in self._splits.items()}

    def _generate_examples(self, files):
        for key, text, rel in self._documents(files):
            if self._tokenizer is None:
                yield key, {"text": text, "source": rel}
            else:
                tok = self._tokenizer
                yield key, {"tokens": np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id]]).astype(np.int32),
                            "source": rel}  # fmt: skip

    def _documents(self, files):
        """(example key, text, file) of every document, in file order."""
        key = self._text_key
        for path, rel in files:
            if path.endswith(".parquet"):
                for i, text in enumerate(_parquet_texts(path, key)):
                    yield f"{rel}:{i}", text, rel
            elif path.endswith(JSON_LINES):
                for i, line in enumerate(_lines(path)):
                    if line.strip():
                        yield f"{rel}:{i}", json.loads(line)[key], rel
            else:
                with open(path, "rb") as f:
                    yield rel, f.read().decode("utf-8", errors="replace"), rel


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


def prepare(name: str, paths: str, data_dir: str, text_key: str = "text", tokenizer=None, made_with=None) -> str:
    """Build the corpus `name` from comma-separated globs ("" = the stdlib) unless it exists; with
    `tokenizer`, its tokenised cache `name`-tokens, recording `made_with` (the tokenizer's identity)."""
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
    config_name = name + TOKENS_SUFFIX if tokenizer is not None else name
    builder = TextFiles(
        splits=splits,
        text_key=text_key,
        tokenizer=tokenizer,
        config=tfds.core.BuilderConfig(name=config_name, description=f"text files from {patterns}"),
        data_dir=data_dir,
        file_format="array_record",
    )
    if tokenizer is not None and builder.is_prepared():
        check_made_with(builder.data_dir, made_with)
    if not builder.is_prepared():
        for f in files:
            _check_text_key(f, text_key)
        tfds.disable_progress_bar()  # TFDS still prints one line when done; its bars would bury the log
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
        if tokenizer is not None:
            with open(os.path.join(builder.data_dir, TOKENIZER_FILE), "w") as f:
                json.dump(made_with, f)
    return builder.data_dir


def check_made_with(directory: str, made_with: dict) -> None:
    """Refuse a tokenised cache made with another tokenizer than the config's."""
    with open(os.path.join(directory, TOKENIZER_FILE)) as f:
        recorded = json.load(f)
    if recorded != made_with:
        raise ConfigError(
            f"the tokenised cache {directory} was made with tokenizer {recorded}, and this config uses "
            f"{made_with}; set data.tokenized=false, or give the corpus another data.name and prepare its cache."
        )
