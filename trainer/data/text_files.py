"""A TFDS builder over local text or JSON-lines files, written to array_record.

Preparing needs no TensorFlow and no network. Each text file is one document;
each line of a .jsonl, .jsonl.gz or .jsonl.zst file is one document, and so is
each row of a .parquet file (its `data.text_key` field or column, default
`text`; checked in every Parquet file and every JSON-lines file's first line
before anything is built). Documents are split into train and validation by a
hash of each one's place (its file's path relative to the corpus root, and its
row or line in the file), `data.validation_fraction` of them held out: stable
across machines and file orders, and one file holds out some of its documents
(a text file, one document, splits as all files did before; see is_validation).
A corpus too small to hold out one document is refused, saying how many it has.
The rule is recorded with the corpus (SPLIT_BY_FILE for one prepared before it
was: whole files, 2% of them), and a corpus and its cache keep the rule they were
first prepared with, so a run resumes on the documents it started with.

The corpus lives at <data_dir>/text_files/<name>/1.0.0 and is read back with
`tfds.data_source("text_files/<name>")`, like any other prepared TFDS dataset.

Its tokenised cache (`data.tokenized`, or `scripts/prepare_data.py --tokenize`)
is the same builder over the same files, holding each document's token ids
(begin and end marks included) instead of its text, as `text_files/<name>-tokens`;
the tokenizer it was made with is written beside it (TOKENIZER_FILE), and a
config with another one is refused.

Each prepared corpus and cache also records what it was made from (MADE_FROM_FILE):
the text field, the split rule and every file's path below the corpus root, size
and a digest of its first and last 64 KiB. A config whose data.paths or data.text_key select
anything else is refused by name; a glob spelt otherwise over the same files, or
the same files moved elsewhere, is the same corpus. A cache whose preparation was
killed after TFDS finished but before its tokenizer was recorded is set aside
(renamed, not deleted) and built again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
import time

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trainer.data.tokenizers import same_tokenizer
from trainer.errors import ConfigError
from trainer.storage.workdir import is_remote, try_writing

# The rule of corpora prepared before the rule was recorded: whole files held out, 2% of them.
SPLIT_BY_FILE = {"by": "file", "fraction": 0.02}
TOKENS_SUFFIX = "-tokens"  # the tokenised cache of corpus <name> is corpus <name>-tokens
TOKENIZER_FILE = "made_with_tokenizer.json"
MADE_FROM_FILE = "made_from.json"
EDGE_BYTES = 64 * 1024  # a file's digest covers its size and this much of its start and its end


def stdlib_patterns() -> list[str]:
    """This interpreter's standard-library sources: a corpus every machine has."""
    return [os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")]


def list_files(patterns: list[str]) -> list[str]:
    files = sorted({f for p in patterns for f in glob.glob(os.path.expanduser(p), recursive=True) if os.path.isfile(f)})
    # The stdlib glob would also reach into installed packages.
    return [f for f in files if f"{os.sep}site-packages{os.sep}" not in f]


def split_by_document(fraction: float) -> dict:
    return {"by": "document", "fraction": fraction}


def is_validation(rule: dict, relative_path: str, index: int | None) -> bool:
    """Whether document `index` (its row or line; None for a file that is one document) of the file at
    `relative_path` below the corpus root is held out under `rule`: a hash of its place, so the split is the
    same on every machine and in any file order.

    The hash's first 4 bytes give thousandths (mod 1000) and the next 8 the finer part: the rule before
    data.validation_fraction held a file out when those thousandths fell below 20, so a corpus of text files
    splits at 0.02 exactly as it did then."""
    place = relative_path if index is None or rule["by"] == "file" else f"{relative_path}:{index}"
    digest = hashlib.sha256(place.encode()).digest()
    position = (int.from_bytes(digest[:4], "big") % 1000) * 2**64 + int.from_bytes(digest[4:12], "big")
    return position < rule["fraction"] * 1000 * 2**64  # in 2^-64 thousandths, compared exactly


class TextFiles(tfds.core.GeneratorBasedBuilder):
    """Local text/jsonl files as a TFDS dataset; the builder config name is the corpus name."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, files: list[tuple[str, str]] = (), rule: dict = SPLIT_BY_FILE, text_key: str = "text",
                 tokenizer=None, **kwargs):  # fmt: skip
        """`files`: [(absolute path, path relative to the corpus root)]. With `tokenizer`, documents are stored
        as token ids (the tokenised cache) instead of text."""
        self._files = files
        self._rule = rule
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
        return {split: self._generate_examples(split == "validation") for split in ("train", "validation")}

    def _generate_examples(self, held_out: bool):
        rule = self._rule
        files = [(path, rel) for path, rel in self._files  # a file held out whole is read for its split alone
                 if rule["by"] == "document" or is_validation(rule, rel, None) == held_out]  # fmt: skip
        for key, text, rel in _documents(files, self._text_key, lambda rel, i: is_validation(rule, rel, i) == held_out):
            if self._tokenizer is None:
                yield key, {"text": text, "source": rel}
            else:
                tok = self._tokenizer
                yield key, {"tokens": np.concatenate([[tok.bos_id], tok.encode(text), [tok.eos_id]]).astype(np.int32),
                            "source": rel}  # fmt: skip


def _documents(files, text_key: str, wanted):
    """(example key, text, file) of every document whose place (file below the root, row or line) is
    `wanted`, in file order; the others are not parsed."""
    for path, rel in files:
        if path.endswith(".parquet"):
            for i, text in enumerate(_parquet_texts(path, text_key)):
                if wanted(rel, i):
                    yield f"{rel}:{i}", text, rel
        elif path.endswith(JSON_LINES):
            for i, line in enumerate(_lines(path)):
                if line.strip() and wanted(rel, i):
                    yield f"{rel}:{i}", _field(line, text_key, path, i + 1), rel
        elif wanted(rel, None):
            with open(path, "rb") as f:
                yield rel, f.read().decode("utf-8", errors="replace"), rel


def _places(path: str, rel: str):
    """(rel, index) of each document of a file, without reading its text: a Parquet file's rows from its
    footer, a JSON-lines file's non-blank lines, a text file's one (index None)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        yield from ((rel, i) for i in range(pq.ParquetFile(path).metadata.num_rows))
    elif path.endswith(JSON_LINES):
        yield from ((rel, i) for i, line in enumerate(_lines(path)) if line.strip())
    else:
        yield rel, None


JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


def _field(line: str, key: str, path: str, number: int) -> str:
    """A JSON line's text field, or one sentence naming the file and line that lack it."""
    try:
        record = json.loads(line)
        return record[key]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        what = "is not a JSON object" if isinstance(e, json.JSONDecodeError) else f"has no field {key!r}"
        raise ConfigError(
            f"line {number} of {path} {what}; fix or remove that line, or set data.text_key to the field holding "
            "the text."
        ) from e


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


def made_from(files: list[tuple[str, str]], text_key: str, rule: dict) -> dict:
    """What a corpus is made from: the text field, the split rule and each file's (path below the root, size,
    digest)."""
    return {"text_key": text_key, "split": rule,
            "files": [[rel, os.path.getsize(f), _edges_digest(f)] for f, rel in files]}  # fmt: skip


def _edges_digest(path: str) -> str:
    """A digest of a file's first and last EDGE_BYTES: cheap for any size, and it changes when the file does
    in all but rare edits of its middle (which change its size, too, unless they replace bytes one for one)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(EDGE_BYTES))
        f.seek(max(0, os.path.getsize(path) - EDGE_BYTES))
        digest.update(f.read(EDGE_BYTES))
    return digest.hexdigest()[:16]


def check_made_from(directory: str, wanted: dict, paths: str, name: str) -> None:
    """Refuse a prepared corpus (or cache) made from other files or another text field than the config selects.
    One prepared before files were recorded is taken as it is; the split rule is settled before (_settled_rule)."""
    record = epath.Path(directory) / MADE_FROM_FILE
    if not record.exists():
        return
    have = json.loads(record.read_text())
    if (have["text_key"], have["files"]) == (wanted["text_key"], wanted["files"]):
        return
    files = {tuple(entry) for entry in have["files"]}
    selected = {tuple(entry) for entry in wanted["files"]}
    differ = f"{len(files - selected)} of its {len(files)} files are not among the {len(selected)} selected"
    if files == selected:
        differ = f"its text was read from field {have['text_key']!r}, not {wanted['text_key']!r}"
    raise ConfigError(
        f"the prepared corpus {name!r} ({directory}) was made from other data than data.paths={paths!r} and "
        f"data.text_key={wanted['text_key']!r} select ({differ}); give this corpus another data.name to prepare "
        "it from these, or move that directory away to rebuild it."
    )


def _settled_rule(data_dir: str, name: str, fraction: float) -> dict:
    """The split rule to prepare corpus `name` (or its cache) with: the one the corpus or its cache was first
    prepared with, so that both hold the same documents for training; else data.validation_fraction's."""
    for config_name in (name, name + TOKENS_SUFFIX):
        directory = epath.Path(data_dir) / "text_files" / config_name / str(TextFiles.VERSION)
        if not (directory / "dataset_info.json").exists():
            continue
        record = directory / MADE_FROM_FILE
        rule = json.loads(record.read_text()).get("split", SPLIT_BY_FILE) if record.exists() else SPLIT_BY_FILE
        if rule["fraction"] != fraction:
            raise ConfigError(
                f"the prepared corpus {config_name!r} ({directory}) holds out {rule['fraction']:g} of its "
                f"{rule['by']}s for validation, and data.validation_fraction={fraction:g} asks for another share; "
                f"set data.validation_fraction={rule['fraction']:g} to read it, or give the corpus another data.name "
                "to prepare it with this one."
            )
        return rule
    return split_by_document(fraction)


def _check_split(files: list[tuple[str, str]], rule: dict, paths: str) -> None:
    """Refuse, before anything is written, a corpus whose split would leave validation or training empty."""
    if rule["by"] == "file":
        places = ((rel, None) for _, rel in files)
    else:
        places = (place for path, rel in files for place in _places(path, rel))
    count = held = 0
    for place in places:
        count, held = count + 1, held + is_validation(rule, *place)
    if 0 < held < count:
        return
    change = "raise data.validation_fraction (at most 0.5)" if held == 0 else "lower data.validation_fraction"
    raise ConfigError(
        f"data.paths={paths!r} gives {count} {rule['by']}{'' if count == 1 else 's'}, too few to hold out a share "
        f"of {rule['fraction']:g} for validation and train on the rest ({held} would be held out); give more "
        f"{rule['by']}s, or {change}."
    )


def prepare(name: str, paths: str, data_dir: str, text_key: str = "text", tokenizer=None, made_with=None,
            validation_fraction: float = 0.02) -> str:  # fmt: skip
    """Build the corpus `name` from comma-separated globs ("" = the stdlib) unless it exists; with
    `tokenizer`, its tokenised cache `name`-tokens, recording `made_with` (the tokenizer's identity)."""
    patterns = [p.strip() for p in paths.split(",") if p.strip()] or stdlib_patterns()
    files = list_files(patterns)
    if not files:
        raise ConfigError(f"data.paths={paths!r} matches no files; give globs such as 'corpus/**/*.txt'.")
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    files = [(f, os.path.relpath(f, root)) for f in files]
    rule = _settled_rule(data_dir, name, validation_fraction)
    config_name = name + TOKENS_SUFFIX if tokenizer is not None else name
    remote = is_remote(data_dir)
    builder = _builder(files, rule, text_key, tokenizer, config_name, patterns, data_dir)
    wanted = made_from(files, text_key, rule)
    if (
        tokenizer is not None
        and not remote  # a bucket's copy is not prepared until its last file is (see _upload)
        and builder.is_prepared()
        and not os.path.exists(os.path.join(builder.data_dir, TOKENIZER_FILE))
    ):  # killed after TFDS finished, before the tokenizer was recorded: which one made it is unknown
        aside = f"{builder.data_dir}.interrupted-{int(time.time())}"
        os.rename(builder.data_dir, aside)
        print(f"the tokenised cache {builder.data_dir} was left unfinished; moved to {aside}, preparing it again")
        builder = _builder(files, rule, text_key, tokenizer, config_name, patterns, data_dir)
    if builder.is_prepared():
        check_made_from(builder.data_dir, wanted, paths, config_name)
        if tokenizer is not None:
            check_made_with(builder.data_dir, made_with)
        return str(builder.data_dir)
    for f, _ in files:
        _check_text_key(f, text_key)
    _check_split(files, rule, paths)
    if not remote:
        _build(builder, wanted, made_with if tokenizer is not None else None)
        return builder.data_dir
    # ArrayRecord writes local files only: build into a local directory, then upload it.
    _check_bucket_writable(data_dir)
    with tempfile.TemporaryDirectory(prefix="trainer-corpus-") as local:
        staged = _builder(files, rule, text_key, tokenizer, config_name, patterns, local)
        _build(staged, wanted, made_with if tokenizer is not None else None)
        _upload(staged.data_dir, str(builder.data_dir))
    return str(builder.data_dir)


def _builder(files, rule, text_key, tokenizer, config_name, patterns, data_dir) -> TextFiles:
    return TextFiles(
        files=files,
        rule=rule,
        text_key=text_key,
        tokenizer=tokenizer,
        config=tfds.core.BuilderConfig(name=config_name, description=f"text files from {patterns}"),
        data_dir=data_dir,
        file_format="array_record",
    )


def _build(builder: TextFiles, wanted: dict, made_with: dict | None) -> None:
    tfds.disable_progress_bar()  # TFDS still prints one line when done; its bars would bury the log
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    # The records last, the tokenizer's after the files' (its absence marks a cache as unfinished).
    _write_json(os.path.join(builder.data_dir, MADE_FROM_FILE), wanted)
    if made_with is not None:
        _write_json(os.path.join(builder.data_dir, TOKENIZER_FILE), made_with)


def _check_bucket_writable(data_dir: str) -> None:
    try:
        try_writing(data_dir)
    except OSError as e:
        raise ConfigError(
            f"cannot write the corpus into data.data_dir={data_dir} ({e}); give a bucket this machine may write."
        ) from e


def _upload(local: str, remote: str) -> None:
    """Copy a prepared corpus into a bucket, dataset_info.json last: TFDS takes a version directory without
    it for an unprepared one, so a copy cut short is prepared again, never read half-made."""
    import fsspec

    fs = fsspec.filesystem("gcs")
    names = sorted(os.listdir(local), key=lambda n: n == "dataset_info.json")
    for name in names:
        fs.put_file(os.path.join(local, name), f"{remote}/{name}")
    fs.invalidate_cache()


def _write_json(path: str, value) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def check_made_with(directory: str, made_with: dict) -> None:
    """Refuse a tokenised cache made with another tokenizer than the config's."""
    recorded = json.loads((epath.Path(directory) / TOKENIZER_FILE).read_text())
    if not same_tokenizer(recorded, made_with):
        raise ConfigError(
            f"the tokenised cache {directory} was made with tokenizer {recorded}, and this config uses "
            f"{made_with}; set data.tokenized=false, or give the corpus another data.name and prepare its cache."
        )
