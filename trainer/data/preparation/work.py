"""The one pass that prepares a corpus: every input file read once, each document written to its split of
the text corpus and, when asked, of the tokenised store.

The work is cut into units before anything runs (`units_of`): a Parquet or JSON-lines file is one unit, and
consecutive text files (one document each) are grouped into units of about UNIT_BYTES. A unit writes one
shard of each split of each dataset (trainer/data/preparation/shards.py), streaming: a document at a time,
never a file's worth in memory. So the prepared corpus (its documents, their order, the split) depends on
the files alone, not on how many workers or which runner did the units.

Units run one after another in this process, or as an Apache Beam pipeline (`--workers N`: Beam's
DirectRunner with N processes; `--beam_options`: any runner's pipeline options, e.g. Dataflow, Spark or
Flink on a cluster). Each unit reports what it has done to a small file of its own in `Plan.reports`
every few seconds and when done (documents, input bytes read, tokens, and its shards' lengths): the
progress lines read them while the units run, and the shards' lengths make the dataset's info after.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import time
import types

import numpy as np

from parallelism.accelerators import stderr_held_back
from trainer.config.errors import ConfigError
from trainer.data import chat
from trainer.data.preparation.inputs import InputFile, documents
from trainer.data.preparation.shards import SPLITS, TOKENS_SUFFIX, ShardWriter
from trainer.data.preparation.split import is_validation, relative
from trainer.storage.workdir import is_remote

UNIT_BYTES = 64 * 2**20  # text files grouped into units of about this much input
REPORT_SECONDS = 2.0  # how often a unit rewrites its report while it runs


@dataclasses.dataclass(frozen=True)
class Unit:
    index: int
    files: tuple[InputFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a unit needs (it travels to Beam's workers): where each dataset's shards go, the split rule,
    the text field, the tokenizer of the store (kind, path) and where units report."""

    text_key: str
    rule: dict
    targets: tuple[tuple[str, str], ...]  # (dataset config name, the directory its shards are written to)
    tokenizer: tuple[str, str, str] | None  # (kind, path, data.chat_template)
    units: int
    reports: str
    format: str = "text"  # data.format: rows of conversations are checked, and rendered for the store
    loss_on: str = "all"


def units_of(files: list[InputFile], unit_bytes: int | None = None) -> list[Unit]:
    unit_bytes = unit_bytes or UNIT_BYTES
    units, group = [], []
    for f in files:
        if not f.one_document:
            if group:
                units.append(group)
                group = []
            units.append([f])
            continue
        group.append(f)
        if sum(g.size for g in group) >= unit_bytes:
            units.append(group)
            group = []
    if group:
        units.append(group)
    return [Unit(i, tuple(files)) for i, files in enumerate(units)]


@functools.cache
def _tokenizer(kind: str, path: str, chat_template: str, format: str):
    """(tokenizer, chat template or None for plain text) of the store, loaded once per process."""
    from trainer.data.chat import template_for
    from trainer.data.tokenizers import load_tokenizer

    cfg = types.SimpleNamespace(tokenizer=kind, tokenizer_path=path, chat_template=chat_template)
    tokenizer = load_tokenizer(cfg)
    return tokenizer, template_for(cfg, tokenizer) if format != "text" else None


def prepare_unit(unit: Unit, plan: Plan) -> None:
    """Write `unit`'s shards of every split of every target, and its report."""
    tokenizer, template = _tokenizer(*plan.tokenizer, plan.format) if plan.tokenizer else (None, None)
    writers = {(name, split): ShardWriter(name, directory, split, unit.index, plan.units, plan.format)
               for name, directory in plan.targets for split in SPLITS}  # fmt: skip
    report = _Report(plan.reports, unit.index)
    try:
        for f in unit.files:
            rel = relative(plan.rule, f)
            for index, text, read in documents(f, plan.text_key, plan.format, plan.loss_on):
                split = "validation" if is_validation(plan.rule, rel, index) else "train"
                if plan.format != "text":  # rendered now, whichever targets are written: a bad row is named here
                    where = f"{'row' if f.path.endswith('.parquet') else 'line'} {index + 1} of {f.path}"
                    example = chat.encode(tokenizer, template, text, where)
                for name, _ in plan.targets:
                    if name.endswith(TOKENS_SUFFIX) and plan.format != "text":
                        writers[name, split].write({**example, "source": rel})
                        report.tokens += sum(len(v) for k, v in example.items() if not k.endswith("turns"))
                    elif name.endswith(TOKENS_SUFFIX):
                        ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(text), [tokenizer.eos_id]])
                        writers[name, split].write({"tokens": ids.astype(np.int32), "source": rel})
                        report.tokens += len(ids)
                    else:
                        writers[name, split].write({"text": text, "source": rel})
                report.documents += 1
                report.text_bytes += len(text.encode("utf-8", errors="replace"))
                report.progress(read)
            report.file_done(f.size)
    except BaseException as e:
        for writer in writers.values():
            writer.discard()
        if isinstance(e, ConfigError):  # said by the driver, which Beam's workers' errors reach only as text
            report.failed(str(e))
        raise
    for writer in writers.values():
        writer.close()
    report.finish({f"{name}/{split}": [w.count, w.bytes] for (name, split), w in writers.items()})


class _Report:
    """A unit's account, in <reports>/<unit>.json: rewritten every REPORT_SECONDS and at the end."""

    def __init__(self, directory: str, unit: int):
        self.path, self.unit = f"{directory}/{unit:05d}.json", unit
        self.documents = self.text_bytes = self.tokens = 0
        self._files_read, self._reading, self._last = 0, 0, time.monotonic()

    def progress(self, read: int) -> None:
        self._reading = read
        if time.monotonic() - self._last >= REPORT_SECONDS:
            self._write(done=False)

    def file_done(self, size: int) -> None:
        self._files_read, self._reading = self._files_read + size, 0

    def finish(self, shards: dict) -> None:
        self._write(done=True, shards=shards)

    def failed(self, sentence: str) -> None:
        self._write(done=False, error=sentence)

    def _write(self, **fields) -> None:
        self._last = time.monotonic()
        account = {"unit": self.unit, "documents": self.documents, "text_bytes": self.text_bytes,
                   "tokens": self.tokens, "read": self._files_read + self._reading, **fields}  # fmt: skip
        _write_text(self.path, json.dumps(account))


def _write_text(path: str, text: str) -> None:
    """Whole or not at all: written aside, then renamed (a bucket's object appears whole anyway)."""
    if is_remote(path):
        import fsspec

        fsspec.filesystem("gcs").pipe_file(path, text.encode())
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def read_reports(directory: str) -> list[dict]:
    """Every unit's latest report (none for a unit not started)."""
    from etils import epath

    folder = epath.Path(directory)
    if not folder.exists():
        return []
    out = []
    for path in folder.glob("*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (ValueError, OSError):  # being replaced as we read: the next look has it
            continue
    return out


def beam_arguments(workers: int, beam_options: str) -> list[str]:
    """The pipeline options: `beam_options` as given (a runner's own), else Beam's DirectRunner with
    `workers` processes on this machine."""
    given = shlex.split(beam_options)
    if any(a.startswith("--runner") for a in given):
        return given
    return [*given, "--runner=DirectRunner", f"--direct_num_workers={workers}",
            "--direct_running_mode=multi_processing"]  # fmt: skip


def runner_name(arguments: list[str]) -> str:
    """The runner the options name, or one sentence if Beam is not installed."""
    try:
        from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
    except ImportError as e:
        raise ConfigError(
            f'preparing with --workers or --beam_options needs Apache Beam ({e}): pip install -e ".[beam]".'
        ) from e
    return PipelineOptions(arguments).view_as(StandardOptions).runner or "DirectRunner"


def check_runner(runner: str) -> None:
    """One sentence if the runner cannot be loaded here; before any write."""
    from apache_beam.runners import create_runner

    try:
        create_runner(runner)
    except (ImportError, ValueError) as e:
        raise ConfigError(
            f"the Beam runner {runner} cannot be loaded here ({' '.join(str(e).split())[:200]}); install its extra "
            f"(e.g. pip install 'apache-beam[gcp]' for DataflowRunner) or name another with --beam_options."
        ) from e


def run(units: list[Unit], plan: Plan, arguments: list[str] | None) -> None:
    """Every unit: in this process, one after another (`arguments` None), or as a Beam pipeline with them."""
    if arguments is None:
        for unit in units:
            prepare_unit(unit, plan)
        return
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    # Beam's workers (processes of their own, with this stderr) log their start and end at length, and its
    # runner each retry's traceback: kept aside, and shown only if the pipeline fails without a sentence of
    # ours (the sentence is made inside, so that what is held back knows it was one).
    with stderr_held_back():
        try:
            with beam.Pipeline(options=PipelineOptions(arguments)) as pipeline:
                _ = (pipeline | "units" >> beam.Create(units) | "spread" >> beam.Reshuffle()
                     | "prepare" >> beam.Map(prepare_unit, plan))  # fmt: skip
        except Exception as e:
            said = [r["error"] for r in read_reports(plan.reports) if r.get("error")]
            if said:  # a unit's own sentence (a line without the text field, say), not Beam's account of it
                raise ConfigError(said[0]) from None
            raise RuntimeError(f"the Beam pipeline failed: {' '.join(str(e).split())[:600]}") from e
