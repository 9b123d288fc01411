"""Where a corpus lives, who prepares it, and whether every host of a run reads the same one.

A corpus is prepared once into `data.data_dir` (default ~/tensorflow_datasets; trainer/data/preparation/):
a local directory, or a `gs://` bucket that every host of a pod reads straight from (ArrayRecord opens
`gs://` shards itself; each process reads only its rows). Megatron's and Dolma's token files are read
where they are, with nothing to prepare (trainer/data/readers/). At a run's start process 0 alone prepares
a text_files corpus that is not there yet (scripts/prepare_data.py does it ahead of time, on Apache Beam
for a large one), so no two hosts ever build into one place at once.

Hosts with disks of their own see a local data_dir each on their own disk. So
before anything compiles every process states what it finds (`statement`: each
split's shard lengths and size, and for text files the record of what it was
made from and with; for token files their sizes), and a process whose statement is not process 0's is
named in one sentence with the command that fixes it (`check_every_host_reads_it`).
"""

from __future__ import annotations

import hashlib
import json
import os

import jax

from parallelism.distributed import differing_from_first
from trainer.config.errors import ConfigError
from trainer.data import preparation, readers
from trainer.data.mixture import parse_mixture
from trainer.data.preparation.split import MADE_FROM_FILE, TOKENIZER_FILE, check_format, check_made_with
from trainer.data.tokenizers import load_tokenizer, made_with

DEFAULT_DIR = readers.DEFAULT_DIR
data_dir = readers.data_dir


def prepare(data_cfg, workers: int = 1, beam_options: str = "", say=print) -> None:
    """Build a text_files corpus if it is not prepared yet (and, with data.tokenized, its tokenised store);
    other sources need nothing."""
    if data_cfg.source == "text_files":
        preparation.prepare(data_cfg, data_dir(data_cfg), workers=workers, beam_options=beam_options, say=say)


def describe(data_cfg) -> str:
    """The run's data line: what it reads, and whether its tokens come from a tokenised store or a tokenizer
    in the loader (data.tokenized picks it for a text_files corpus)."""
    if data_cfg.source == "synthetic":
        return "data: synthetic tokens (data.source=synthetic)"
    parts = []
    for corpus in corpora_read(data_cfg):
        which = readers.kind(data_cfg, corpus)
        if which in ("megatron", "dolma"):
            how = f"token ids read as they are ({'Megatron .bin/.idx' if which == 'megatron' else 'Dolma .npy'})"
        elif data_cfg.format == "prompts" and not data_cfg.tokenized:  # answers from the text store in both
            how = (f"prompts rendered and tokenised on the fly by the {data_cfg.tokenizer} tokenizer "
                   "(data.tokenized=true reads their tokens from a tokenised store instead)")  # fmt: skip
        elif which == "text_files" and data_cfg.tokenized:
            how = "read from its tokenised store (data.tokenized=true)"
        else:
            how = f"tokenised on the fly by the {data_cfg.tokenizer} tokenizer" + (
                " (data.tokenized=true reads a tokenised store instead)" if which == "text_files" else ""
            )
        parts.append(f"{corpus} ({data_cfg.format}), {how}")
    return "data: " + "; ".join(parts)


def text_feature(data_cfg) -> str:
    """The prepared examples' text feature: a text_files corpus stores `text`, whichever field of its
    files held it (data.text_key); a TFDS dataset has its own."""
    return "text" if data_cfg.source == "text_files" else data_cfg.text_key


def open_split(data_cfg, split: str):
    """A random-access source of examples (dicts) for one split of data.name."""
    return readers.open_split(data_cfg, data_cfg.name, split)


def corpora_read(data_cfg) -> list[str]:
    """The corpora the run reads: data.name, or each corpus of a mixture."""
    return [name for name, _ in parse_mixture(data_cfg.mixture)] or [data_cfg.name]


def names(data_cfg) -> list[str]:
    """The prepared datasets the run reads, as TFDS names them (token files: their paths)."""
    return [readers.tfds_name(data_cfg, c) if readers.kind(data_cfg, c) in ("text_files", "tfds") else c
            for c in corpora_read(data_cfg)]  # fmt: skip


def check_prepared(data_cfg, split: str) -> None:
    """Refuse, in one sentence, a corpus the run reads that is not prepared, or a tokenised store made with
    another tokenizer (this process must hold the tokenizer)."""
    for corpus in corpora_read(data_cfg):
        readers.open_split(data_cfg, corpus, split)
    _check_made_with(data_cfg)


def _check_made_with(data_cfg) -> None:
    _check_format(data_cfg)
    if data_cfg.tokenized:
        for corpus in corpora_read(data_cfg):
            if readers.kind(data_cfg, corpus) == "text_files":
                name = readers.tfds_name(data_cfg, corpus)
                check_made_with(str(readers.directory(data_cfg, name)), made_with(data_cfg))


def _check_format(data_cfg) -> None:
    """Refuse a prepared corpus read as another data.format than it was prepared as (its rows are plain text,
    or conversations, or pairs)."""
    for corpus in corpora_read(data_cfg):
        if readers.kind(data_cfg, corpus) != "text_files":
            continue
        directory = readers.directory(data_cfg, readers.tfds_name(data_cfg, corpus))
        record = directory / MADE_FROM_FILE
        made = json.loads(record.read_text())["text_key"] if record.exists() else data_cfg.text_key
        check_format(corpus, directory, made, data_cfg.format)


def statement(data_cfg, splits: list[str]) -> str:
    """What this process finds of the corpora the run reads: each split's shard lengths and bytes, and what
    a text_files corpus records of its files and tokenizer (token files: their documents and sizes). Equal
    statements, equal data. Raises ConfigError for a corpus this process does not find."""
    found = []
    for corpus in corpora_read(data_cfg):
        which = readers.kind(data_cfg, corpus)
        if which in ("megatron", "dolma"):
            found.append([corpus, [len(readers.open_split(data_cfg, corpus, s)) for s in splits],
                          sorted(os.path.getsize(p) for p in _token_paths(data_cfg, corpus))])  # fmt: skip
            continue
        name = readers.tfds_name(data_cfg, corpus)
        for split in splits:
            info = readers.open_prepared(data_cfg, name, split).dataset_info.splits[split]
            found.append([name, split, list(info.shard_lengths), info.num_bytes])
        if which == "text_files":
            for record in (MADE_FROM_FILE, TOKENIZER_FILE):
                file = readers.directory(data_cfg, name) / record
                found.append([record, json.loads(file.read_text()) if file.exists() else None])
    return json.dumps(found, sort_keys=True)


def _token_paths(data_cfg, corpus: str) -> list[str]:
    import glob

    paths = readers.paths_of(data_cfg, corpus)
    if readers.kind(data_cfg, corpus) == "megatron":
        return [os.path.expanduser(p) + suffix for p in paths for suffix in (".bin", ".idx")]
    return [f for p in paths for f in glob.glob(os.path.expanduser(p))]


MISSING = "missing"


def check_every_host_reads_it(data_cfg, splits: list[str]) -> None:
    """Refuse, before anything compiles, a run whose processes do not all read the corpus process 0 has (a
    collective: every process calls it, after process 0 has prepared it). Process 0 also checks a tokenised
    store against its tokenizer."""
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
