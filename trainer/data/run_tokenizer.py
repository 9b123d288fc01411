"""The tokenizer a run trains with, kept in its run directory (<workdir>/tokenizer/), so the run is
self-contained.

At a run's first start process 0 copies the tokenizer's file there (for a Hugging
Face tokenizer, its tokenizer.json and any tokenizer_config.json beside it), then
a record of where it came from and its sha256, last. From then on every reader of
the run reads that copy: every host of the run (hosts of a pod that never had the
file), a resume, eval.py, generate.py and convert_hf.py on another machine. A
config whose `data.tokenizer_path` holds a different file is refused by name: the
run's weights mean nothing under other ids. The byte tokenizer has no file.

A run started before copies were kept gets its copy at its next start, from the
path its config.json names (another path is refused, as it always was).

A `data.chat_template` file (trainer/data/chat.py) is kept there too, and read
from there after the run's start: another template is refused the same way.
"""

from __future__ import annotations

import json

from etils import epath

from trainer.config.errors import ConfigError
from trainer.data.chat import TEMPLATE_FILE
from trainer.data.tokenizers import HF_CONFIG, digest, tokenizer_file
from trainer.storage import workdir as wd

COPY_DIR = "tokenizer"
RECORD = "copied_from.json"  # written last: a copy without it is unfinished


def _record(workdir: str) -> dict | None:
    file = wd.path(workdir) / COPY_DIR / RECORD
    return json.loads(file.read_text()) if file.exists() else None


def recorded_digest(workdir: str) -> str | None:
    """The sha256 of the tokenizer file a run keeps (None where it keeps none: the byte tokenizer, or a run
    from before copies were kept)."""
    record = _record(workdir)
    return None if record is None else record["sha256"]


def check_same_tokens(cfg, source: str, theirs, given: str, whom: str, why: str) -> None:
    """Refuse what `given` names (the directory `source`, whose config is `theirs`: a teacher, or weights to
    start from) when it reads other tokens than `cfg`: another vocabulary size, kind of tokenizer or tokenizer
    file (by its sha256, as the run recorded it). Its ids would mean other tokens, without a word."""
    recorded = recorded_digest(source)
    mine = (cfg.model.vocab_size, cfg.data.tokenizer, digest(cfg.data))
    other = (theirs.model.vocab_size, theirs.data.tokenizer, digest(theirs.data) if recorded is None else recorded)
    if mine != other:
        said = lambda c, v: f"model.vocab_size={v}, data.tokenizer={c.data.tokenizer} {c.data.tokenizer_path!r}"  # noqa: E731
        raise ConfigError(f"{given} reads other tokens ({said(theirs, other[0])}) than {whom} ({said(cfg, mine[0])}); "
                          f"{why}.")  # fmt: skip


def _with_path(cfg, location: str):
    out = cfg.copy_and_resolve_references()
    out.data.tokenizer_path = location
    return out


def settle(cfg, workdir: str):
    """`cfg` reading the run's copy of its tokenizer (and of a data.chat_template file), where the run has
    started and has one; else `cfg` as it is. Refuses a file at data.tokenizer_path (where this process has
    one) that is not that copy."""
    return _settle_tokenizer(_settle_template(cfg, workdir), workdir)


# A data.chat_template file, kept beside the tokenizer's copy: the run's conversations were rendered with it.
TEMPLATE_COPY = "data_chat_template.jinja"


def _settle_template(cfg, workdir: str):
    given = cfg.data.chat_template
    copy = wd.path(workdir) / COPY_DIR / TEMPLATE_COPY
    if not given or wd.saved_config(workdir) is None or not copy.exists():
        return cfg
    if epath.Path(given).expanduser().exists() and epath.Path(given).expanduser().read_text() != copy.read_text():
        raise ConfigError(
            f"data.chat_template={given!r} is another template than the one {workdir} was trained with (copied to "
            f"{copy}); point data.chat_template at that copy, or train another run (another --workdir)."
        )
    out = cfg.copy_and_resolve_references()
    out.data.chat_template = str(copy)
    return out


def _settle_tokenizer(cfg, workdir: str):
    saved_cfg = wd.saved_config(workdir) if cfg.data.tokenizer != "byte" else None
    if saved_cfg is None:
        return cfg
    record = _record(workdir)
    given = cfg.data.tokenizer_path
    if record is None:  # a run from before copies were kept: its config names its tokenizer
        saved = saved_cfg["data"].get("tokenizer_path", "")
        if saved != given:
            raise ConfigError(
                f"{workdir} was trained with data.tokenizer_path={saved!r} and keeps no copy of it; use that path."
            )
        return cfg
    copy = _location(workdir, record)
    if record["tokenizer"] == cfg.data.tokenizer and given and _exists(cfg):
        have = digest(cfg.data)
        if have != record["sha256"]:
            raise ConfigError(
                f"data.tokenizer_path={given!r} is another tokenizer (sha256 {have[:12]}) than the one {workdir} "
                f"was trained with ({record['from']}, sha256 {record['sha256'][:12]}, copied to {copy}); point "
                "data.tokenizer_path at that copy, or train another run (another --workdir)."
            )
    return _with_path(cfg, copy)


def _exists(cfg) -> bool:
    return epath.Path(tokenizer_file(cfg.data.tokenizer, cfg.data.tokenizer_path)).exists()


def store(cfg, workdir: str) -> None:
    """Copy the config's tokenizer into the run directory, unless the run has started with a copy already
    (process 0, once every check has passed). Nothing is stored for a file this machine does not have:
    a run that reads no text (a synthetic source) may name one it never opens."""
    template = epath.Path(cfg.data.chat_template).expanduser() if cfg.data.chat_template else None
    if template is not None and template.exists() and template != wd.path(workdir) / COPY_DIR / TEMPLATE_COPY:
        wd.write_file(wd.path(workdir) / COPY_DIR / TEMPLATE_COPY, template.read_bytes())
    if cfg.data.tokenizer == "byte" or not _exists(cfg):
        return
    if wd.saved_config(workdir) is not None and _record(workdir) is not None:
        return
    source = epath.Path(tokenizer_file(cfg.data.tokenizer, cfg.data.tokenizer_path))
    target = wd.path(workdir) / COPY_DIR
    files = [source]
    for beside in (HF_CONFIG, TEMPLATE_FILE):  # a Hugging Face tokenizer's marks and chat template
        if cfg.data.tokenizer == "hf" and (source.parent / beside).exists():
            files.append(source.parent / beside)
    for file in files:
        wd.write_file(target / file.name, file.read_bytes())
    # A Hugging Face tokenizer is read from its directory (its config beside it); SentencePiece from its file.
    name = "" if cfg.data.tokenizer == "hf" else source.name
    record = {"tokenizer": cfg.data.tokenizer, "from": str(source), "name": name, "sha256": digest(cfg.data)}
    wd.write_file(target / RECORD, json.dumps(record))


def use_copy(cfg, workdir: str):
    """`cfg` reading the run's copy, once process 0 has stored it (every process, after a barrier)."""
    copy = wd.path(workdir) / COPY_DIR / TEMPLATE_COPY
    if cfg.data.chat_template and copy.exists():
        cfg = cfg.copy_and_resolve_references()
        cfg.data.chat_template = str(copy)
    record = _record(workdir) if cfg.data.tokenizer != "byte" else None
    return cfg if record is None else _with_path(cfg, _location(workdir, record))


def _location(workdir: str, record: dict) -> str:
    copy = wd.path(workdir) / COPY_DIR
    return str(copy / record["name"] if record["name"] else copy)
