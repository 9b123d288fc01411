"""Where a prepared corpus lives, who prepares it, and whether every host of a run reads the same one.

A corpus is prepared once into `data.data_dir` (default ~/tensorflow_datasets):
a local directory, or a `gs://` bucket that every host of a pod reads straight
from (ArrayRecord opens `gs://` shards itself; each process reads only its
rows). At a run's start process 0 alone prepares a text_files corpus that is
not there yet (scripts/prepare_data.py does it ahead of time), so no two hosts
ever build into one place at once.

Hosts with disks of their own see a local data_dir each on their own disk. So
before anything compiles every process states what it finds (`statement`: each
split's shard lengths and size, and for text files the record of what it was
made from and with), and a process whose statement is not process 0's is named
in one sentence with the command that fixes it (`check_every_host_reads_it`).
"""

from __future__ import annotations

import hashlib
import json

import jax
import tensorflow_datasets as tfds
from etils import epath

from parallelism.distributed import differing_from_first
from trainer.data import text_files
from trainer.data.mixture import parse_mixture
from trainer.data.tokenizers import load_tokenizer, made_with
from trainer.errors import ConfigError
from trainer.storage.workdir import is_remote

DEFAULT_DIR = "~/tensorflow_datasets"
VERSION = "1.0.0"  # text_files' one version


def data_dir(data_cfg) -> str:
    location = data_cfg.data_dir or DEFAULT_DIR
    return location if is_remote(location) else str(epath.Path(location).expanduser())


def prepare(data_cfg) -> None:
    """Build a text_files corpus if it is not prepared yet (and, with data.tokenized, its tokenised cache);
    other sources need nothing."""
    if data_cfg.source == "text_files":
        d = data_cfg
        text_files.prepare(d.name, d.paths, data_dir(d), d.text_key, validation_fraction=d.validation_fraction)
        if d.tokenized:
            text_files.prepare(d.name, d.paths, data_dir(d), d.text_key, load_tokenizer(d), made_with(d),
                               d.validation_fraction)  # fmt: skip


def text_feature(data_cfg) -> str:
    """The prepared examples' text feature: a text_files corpus stores `text`, whichever field of its
    files held it (data.text_key); a TFDS dataset has its own."""
    return "text" if data_cfg.source == "text_files" else data_cfg.text_key


def open_split(data_cfg, split: str):
    """A random-access source of examples (dicts) for one split of data.name."""
    return open_corpus(data_cfg, data_cfg.name, split)


def names(data_cfg) -> list[str]:
    """The prepared datasets the run reads (data.name, or each corpus of a mixture), as TFDS names them."""
    read = [name for name, _ in parse_mixture(data_cfg.mixture)] or [data_cfg.name]
    suffix = text_files.TOKENS_SUFFIX if data_cfg.tokenized else ""
    return [f"text_files/{c}{suffix}" if data_cfg.source == "text_files" else c for c in read]


def open_corpus(data_cfg, corpus: str, split: str):
    """A random-access source of one split of `corpus` (a name of data.name's kind, without the cache suffix)."""
    suffix = text_files.TOKENS_SUFFIX if data_cfg.tokenized else ""
    return _open(data_cfg, f"text_files/{corpus}{suffix}" if data_cfg.source == "text_files" else corpus, split)


def _open(data_cfg, name: str, split: str):
    """One split of the prepared dataset TFDS calls `name` (names() gives the run's)."""
    try:
        if data_cfg.source == "text_files" and not (_directory(data_cfg, name) / "dataset_info.json").exists():
            raise tfds.core.registered.DatasetNotFoundError(name)  # TFDS would say its builder config is unknown
        return tfds.data_source(name, split=split, data_dir=data_dir(data_cfg), download=False)
    except tfds.core.registered.DatasetNotFoundError as e:
        hint = (
            "run scripts/prepare_data.py with this config"
            if data_cfg.source == "text_files"
            else "prepare it with TFDS in array_record format"
        )
        raise ConfigError(f"dataset {name!r} is not prepared under {data_dir(data_cfg)}; {hint}.") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"dataset {name!r} has no split {split!r} ({e}).") from e


def _directory(data_cfg, name: str) -> epath.Path:
    return epath.Path(data_dir(data_cfg)) / name / VERSION


def check_prepared(data_cfg, split: str) -> None:
    """Refuse, in one sentence, a corpus the run reads that is not prepared, or a tokenised cache made with
    another tokenizer (this process must hold the tokenizer)."""
    for name in names(data_cfg):
        _open(data_cfg, name, split)
    _check_made_with(data_cfg)


def _check_made_with(data_cfg) -> None:
    if data_cfg.tokenized:
        for name in names(data_cfg):
            text_files.check_made_with(str(_directory(data_cfg, name)), made_with(data_cfg))


def statement(data_cfg, splits: list[str]) -> str:
    """What this process finds of the corpora the run reads: each split's shard lengths and bytes, and what
    a text_files corpus records of its files and tokenizer. Equal statements, equal data. Raises ConfigError
    for a corpus this process does not find."""
    found = []
    for name in names(data_cfg):
        for split in splits:
            info = _open(data_cfg, name, split).dataset_info.splits[split]
            found.append([name, split, list(info.shard_lengths), info.num_bytes])
        if data_cfg.source == "text_files":
            for record in (text_files.MADE_FROM_FILE, text_files.TOKENIZER_FILE):
                file = _directory(data_cfg, name) / record
                found.append([record, json.loads(file.read_text()) if file.exists() else None])
    return json.dumps(found, sort_keys=True)


MISSING = "missing"


def check_every_host_reads_it(data_cfg, splits: list[str]) -> None:
    """Refuse, before anything compiles, a run whose processes do not all read the corpus process 0 has (a
    collective: every process calls it, after process 0 has prepared it). Process 0 also checks a tokenised
    cache against its tokenizer."""
    me = jax.process_index()
    try:
        mine = statement(data_cfg, splits)
    except ConfigError:
        if me == 0:
            raise
        mine = MISSING
    if me == 0:
        _check_made_with(data_cfg)
    if jax.process_count() == 1:
        return
    differ = differing_from_first(hashlib.sha256(mine.encode()).digest())
    if not differ:
        return
    missing = hashlib.sha256(MISSING.encode()).digest()
    what = [f"{p} ({'none' if value == missing else 'another copy'})" for p, value in differ]
    where = data_cfg.data_dir or DEFAULT_DIR
    raise ConfigError(
        f"process{'es' if len(differ) > 1 else ''} {', '.join(what)} of {jax.process_count()} cannot read the corpus "
        f"process 0 has ({', '.join(names(data_cfg))} under data.data_dir={where!r}; hosts with disks of their own "
        "each see their own copy); prepare it once where every host reads it, python scripts/prepare_data.py "
        "with this --config and --config.data.data_dir=gs://BUCKET/tfds, and train with that data.data_dir."
    )


def check_vocab(cfg) -> None:
    if cfg.data.source == "synthetic":
        return
    size = load_tokenizer(cfg.data).vocab_size
    if size > cfg.model.vocab_size:
        raise ConfigError(
            f"the {cfg.data.tokenizer} tokenizer has {size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"raise model.vocab_size to at least {size} (a multiple of 128 shards best)."
        )
