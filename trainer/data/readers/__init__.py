"""Reading a corpus, whatever wrote it, behind the one interface the streams use (trainer/data/streams.py):
one split as a random-access sequence of documents, `len()` and `[i]`, each a dict with its `text`, or its
`tokens` (int32) when the corpus holds token ids.

    prepared   a corpus prepared here (trainer/data/preparation/: its text, or its tokenised store) or any
               TFDS dataset prepared in array_record, through `tfds.data_source`
    megatron   Megatron-LM's indexed datasets (.bin + .idx), as they are (megatron.py)
    dolma      OLMo-core's and Dolma's flat token files (.npy), as they are (dolma.py)

Which one reads a corpus follows from data.source, or, for an entry of data.mixture, from its form: a
path (absolute, './', '~' or 'gs://') ending in .npy (a glob allowed) is Dolma's, any other path the prefix
of a Megatron dataset, and a bare name a corpus of data.source's kind under data.data_dir. So one mixture
draws from all three by token weight.
"""

from __future__ import annotations

import functools
import glob
import os

import tensorflow_datasets as tfds
from etils import epath

from trainer.config.errors import ConfigError
from trainer.storage.workdir import is_remote

TOKENS_SUFFIX = "-tokens"  # as trainer/data/preparation/shards.py names a corpus's tokenised store
DEFAULT_DIR = "~/tensorflow_datasets"
VERSION = "1.0.0"  # text_files' one version


def data_dir(data_cfg) -> str:
    location = data_cfg.data_dir or DEFAULT_DIR
    return location if is_remote(location) else str(epath.Path(location).expanduser())


def kind(data_cfg, corpus: str) -> str:
    """'megatron', 'dolma', or data.source for a corpus prepared under data.data_dir."""
    path_like = corpus.startswith(("/", "./", "~", "gs://"))
    if path_like:
        return "dolma" if corpus.endswith(".npy") else "megatron"
    return data_cfg.source


def holds_tokens(data_cfg, corpus: str) -> bool:
    return kind(data_cfg, corpus) in ("megatron", "dolma") or bool(data_cfg.tokenized)


def tfds_name(data_cfg, corpus: str) -> str:
    """The TFDS name of a prepared corpus (its tokenised store with data.tokenized)."""
    suffix = TOKENS_SUFFIX if data_cfg.tokenized else ""
    return f"text_files/{corpus}{suffix}" if data_cfg.source == "text_files" else corpus


def open_split(data_cfg, corpus: str, split: str):
    """One split of `corpus` (data.name, or an entry of data.mixture), ready to be indexed."""
    which = kind(data_cfg, corpus)
    if which in ("megatron", "dolma"):
        return _token_files(data_cfg, which, paths_of(data_cfg, corpus), split)
    name = tfds_name(data_cfg, corpus)
    if data_cfg.source == "text_files" and data_cfg.tokenized and getattr(data_cfg, "format", "text") == "text":
        from trainer.data.readers.store import Tokens, flat

        where = directory(data_cfg, name)
        rebuild = (f"move {where} aside and run scripts/prepare_data.py with this config and --tokenize to write "
                   "it again.")  # fmt: skip
        found = None if is_remote(str(where)) else flat(str(where), split, rebuild)
        return found if found is not None else Tokens(open_prepared(data_cfg, name, split, raw=True))
    return open_prepared(data_cfg, name, split)


def paths_of(data_cfg, corpus: str) -> list[str]:
    """The files (Dolma) or prefixes (Megatron) of an external corpus: the mixture entry's path, or data.paths
    (comma-separated) for a corpus that is data.source."""
    if corpus.startswith(("/", "./", "~", "gs://")):
        return [corpus]
    return [p.strip() for p in data_cfg.paths.split(",") if p.strip()]


def _token_files(data_cfg, which: str, paths: list[str], split: str):
    from trainer.data.readers.tokens import Files

    vocab = getattr(data_cfg, "vocab_size", None) or 2**63  # a config's data section alone: no model to check
    if which == "megatron":
        names = [os.path.expanduser(p) for p in paths]
        files = [_token_file("megatron", p, "", -1, vocab, _stamp(f"{p}.bin", f"{p}.idx")) for p in names]
    else:
        names = sorted({f for p in paths for f in glob.glob(os.path.expanduser(p))})
        if not names:
            raise ConfigError(f"{','.join(paths)} matches no token files; give Dolma's .npy files (a glob is fine).")
        eos = data_cfg.eos_id if data_cfg.eos_id >= 0 else _tokenizer_eos(data_cfg)
        files = [_token_file("dolma", p, data_cfg.token_dtype, eos, vocab, _stamp(p)) for p in names]
    return Files(files, split, data_cfg.validation_fraction, vocab, names)


@functools.lru_cache(maxsize=256)
def _token_file(which: str, path: str, dtype: str, eos: int, vocab: int, stamp: tuple):
    """A token file opened once per process (a Dolma file is read whole to find its documents' ends), with its
    size and time as part of the key, so a rewritten file is opened again."""
    from trainer.data.readers.dolma import DolmaFile
    from trainer.data.readers.megatron import MegatronFile

    return MegatronFile(path, vocab) if which == "megatron" else DolmaFile(path, dtype, eos, vocab)


def _stamp(*paths: str) -> tuple:
    return tuple((os.path.getsize(p), os.path.getmtime(p)) if os.path.exists(p) else None for p in paths)


def _tokenizer_eos(data_cfg) -> int:
    from trainer.data.tokenizers import load_tokenizer

    return load_tokenizer(data_cfg).eos_id


def open_prepared(data_cfg, name: str, split: str, raw: bool = False):
    """One split of the prepared dataset TFDS calls `name`, through tfds.data_source; with `raw`, its records
    as they are stored (serialised Examples, for trainer/data/readers/store.py)."""
    how = tfds.decode.DeserializeMethod.RAW_BYTES if raw else tfds.decode.DeserializeMethod.DESERIALIZE_AND_DECODE
    try:
        if data_cfg.source == "text_files" and not (directory(data_cfg, name) / "dataset_info.json").exists():
            raise tfds.core.registered.DatasetNotFoundError(name)  # TFDS would say its builder config is unknown
        return tfds.data_source(name, split=split, data_dir=data_dir(data_cfg), download=False, deserialize_method=how)
    except tfds.core.registered.DatasetNotFoundError as e:
        hint = (
            "run scripts/prepare_data.py with this config"
            if data_cfg.source == "text_files"
            else "prepare it with TFDS in array_record format"
        )
        raise ConfigError(f"dataset {name!r} is not prepared under {data_dir(data_cfg)}; {hint}.") from e
    except (KeyError, ValueError) as e:
        raise ConfigError(f"dataset {name!r} has no split {split!r} ({e}).") from e


def directory(data_cfg, name: str) -> epath.Path:
    return epath.Path(data_dir(data_cfg)) / name / VERSION
