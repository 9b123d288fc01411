"""Which documents are held out, and what a prepared corpus records of what it was made from.

A document's side is a hash of its place: its file's path below its own glob's root, and its row or line
in the file (a text file is one document). It depends on that document alone: the same on every
machine, in any file order, whatever other directories join the corpus. Corpora keep the rule they were
first prepared with (recorded in MADE_FROM_FILE), so their tokenised store holds out the same documents:
whole files at 2% (SPLIT_BY_FILE) for the oldest, and paths below the common root of all the files for
those prepared before places were per glob (a rule without "root").
"""

from __future__ import annotations

import hashlib
import json
import os

from etils import epath

from trainer.config.errors import ConfigError
from trainer.data.chat import format_of
from trainer.data.preparation.inputs import InputFile
from trainer.data.tokenizers import same_tokenizer

SPLIT_BY_FILE = {"by": "file", "fraction": 0.02}  # corpora prepared before data.validation_fraction
MADE_FROM_FILE = "made_from.json"
TOKENIZER_FILE = "made_with_tokenizer.json"
EDGE_BYTES = 64 * 1024  # a file's digest covers its size and this much of its start and its end


def split_by_document(fraction: float) -> dict:
    return {"by": "document", "fraction": fraction, "root": "glob"}


def relative(rule: dict, file: InputFile) -> str:
    """The file's path as `rule` hashes it: below its glob's root, or (older rules) the common root."""
    return file.place if rule.get("root") == "glob" else file.common


def is_validation(rule: dict, relative_path: str, index: int | None) -> bool:
    """Whether document `index` (its row or line; None for a file that is one document) of the file at
    `relative_path` is held out under `rule`.

    The hash's first 4 bytes give thousandths (mod 1000) and the next 8 the finer part: the rule before
    data.validation_fraction held a file out when those thousandths fell below 20, so a corpus of text files
    splits at 0.02 exactly as it did then."""
    place = relative_path if index is None or rule["by"] == "file" else f"{relative_path}:{index}"
    digest = hashlib.sha256(place.encode()).digest()
    position = (int.from_bytes(digest[:4], "big") % 1000) * 2**64 + int.from_bytes(digest[4:12], "big")
    return position < rule["fraction"] * 1000 * 2**64  # in 2^-64 thousandths, compared exactly


def settled_rule(directories: list[epath.Path], fraction: float) -> dict:
    """The rule to prepare a corpus with: the one it (or its tokenised store) was first prepared with, found
    in `directories`, so that both hold the same documents for training; else data.validation_fraction's."""
    for directory in directories:
        if not (directory / "dataset_info.json").exists():
            continue
        record = directory / MADE_FROM_FILE
        rule = json.loads(record.read_text()).get("split", SPLIT_BY_FILE) if record.exists() else SPLIT_BY_FILE
        if rule["fraction"] != fraction:
            raise ConfigError(
                f"the prepared corpus {directory.parent.name!r} ({directory}) holds out {rule['fraction']:g} of its "
                f"{rule['by']}s for validation, and data.validation_fraction={fraction:g} asks for another share; "
                f"set data.validation_fraction={rule['fraction']:g} to read it, or give the corpus another data.name "
                "to prepare it with this one."
            )
        return rule
    return split_by_document(fraction)


def made_from(files: list[InputFile], text_key: str, rule: dict) -> dict:
    """What a corpus is made from: the text field, the split rule and each file's (path as the rule hashes it,
    size, digest)."""
    return {"text_key": text_key, "split": rule,
            "files": [[relative(rule, f), f.size, _edges_digest(f.path)] for f in files]}  # fmt: skip


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
    """Refuse a prepared corpus (or store) made from other files or another text field than the config
    selects. One prepared before files were recorded is taken as it is."""
    record = epath.Path(directory) / MADE_FROM_FILE
    if not record.exists():
        return
    have = json.loads(record.read_text())
    if (have["text_key"], have["files"]) == (wanted["text_key"], wanted["files"]):
        return
    check_format(name, directory, have["text_key"], format_of(wanted["text_key"]))
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


def check_recorded_format(name: str, directory: epath.Path, text_key: str) -> None:
    """check_format against what the prepared corpus in `directory` (if any) recorded of its files."""
    record = directory / MADE_FROM_FILE
    if (directory / "dataset_info.json").exists() and record.exists():
        check_format(name, directory, json.loads(record.read_text())["text_key"], format_of(text_key))


def check_format(name: str, directory, recorded: str, read_as: str) -> None:
    """Refuse a prepared corpus read as another data.format than it was prepared as (`recorded`: the text
    field its made_from.json names)."""
    prepared_as = format_of(recorded)
    if prepared_as != read_as:
        raise ConfigError(
            f"the corpus {name!r} ({directory}) was prepared with data.format={prepared_as}, and this config reads "
            f"it with data.format={read_as}; set data.format={prepared_as}, or prepare the files under another "
            "data.name."
        )


def check_made_with(directory: str, made_with: dict) -> None:
    """Refuse a tokenised store made with another tokenizer than the config's."""
    recorded = json.loads((epath.Path(directory) / TOKENIZER_FILE).read_text())
    if not same_tokenizer(recorded, made_with):
        raise ConfigError(
            f"the tokenised cache {directory} was made with tokenizer {recorded}, and this config uses "
            f"{made_with}; set data.tokenized=false, or give the corpus another data.name and prepare its cache."
        )


def check_both_sides(counts: dict[str, int], rule: dict, paths: str) -> None:
    """Refuse a corpus whose split left validation or training empty (`counts`: documents per split)."""
    held, count = counts["validation"], counts["validation"] + counts["train"]
    if 0 < held < count:
        return
    change = "raise data.validation_fraction (at most 0.5)" if held == 0 else "lower data.validation_fraction"
    raise ConfigError(
        f"data.paths={paths!r} gives {count} document{'' if count == 1 else 's'}, too few to hold out a share "
        f"of {rule['fraction']:g} for validation and train on the rest ({held} would be held out); give more "
        f"documents, or {change}."
    )
