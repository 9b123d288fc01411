"""A TFDS builder over local text or JSON-lines files, written to array_record.

Preparing needs no TensorFlow and no network. Each text file is one document;
each line of a .jsonl file is one document (its `text` field). Files are split
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

    def __init__(self, *, splits: dict[str, list[tuple[str, str]]] | None = None, **kwargs):
        self._splits = splits or {}  # split -> [(absolute path, path relative to the corpus root)]
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({"text": tfds.features.Text(), "source": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(files) for split, files in self._splits.items()}

    def _generate_examples(self, files):
        for path, rel in files:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            if path.endswith(".jsonl"):
                for i, line in enumerate(text.splitlines()):
                    if line.strip():
                        yield f"{rel}:{i}", {"text": json.loads(line)["text"], "source": rel}
            else:
                yield rel, {"text": text, "source": rel}


def prepare(name: str, paths: str, data_dir: str) -> str:
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
        config=tfds.core.BuilderConfig(name=name, description=f"text files from {patterns}"),
        data_dir=data_dir,
        file_format="array_record",
    )
    if not builder.is_prepared():
        tfds.disable_progress_bar()  # TFDS still prints one line when done; its bars would bury the log
        builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder.data_dir
