"""Preparing a text_files corpus: its documents split into train and validation, in one pass over its files,
and with `data.tokenized` its tokenised store, written in that same pass.

    inputs.py    the files (globs, their roots) and the documents in them
    split.py     which documents are held out; what a corpus records of what it was made from
    shards.py    the corpus on disk: TFDS array_record shards (a text store's flat token files beside them)
                 and dataset_info.json
    work.py      the pass: units of files, each writing its own shards, in this process or on Apache Beam
    progress.py  what a long preparation says while it runs
    publishing.py  staging, publishing whole, one builder at a time

`prepare` builds whatever of the two is missing, apart, and publishes it whole, so no reader ever opens a
half-made corpus; on a local disk one process builds a corpus at a time, and a second waits, then uses
what the first made (publishing.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from trainer.config.errors import ConfigError
from trainer.data import chat
from trainer.data.preparation import inputs, publishing, shards, split, work
from trainer.data.preparation.progress import Progress
from trainer.data.tokenizers import load_tokenizer, made_with
from trainer.storage.workdir import is_remote, try_writing


def prepare(data_cfg, data_dir: str, *, workers: int = 1, beam_options: str = "",
            say: Callable[[str], None] = print) -> None:  # fmt: skip
    """Build corpus data.name from data.paths (comma-separated globs; "" = this Python's standard library)
    unless it is prepared, and with data.tokenized its tokenised store; check what is there against the
    config. `workers` > 1 or `beam_options` run the pass on Apache Beam."""
    d = data_cfg
    wanted = [d.name] + [d.name + shards.TOKENS_SUFFIX] * bool(d.tokenized)
    patterns = [p.strip() for p in d.paths.split(",") if p.strip()] or inputs.stdlib_patterns()
    files = inputs.list_files(patterns)
    if not files:
        raise ConfigError(f"data.paths={d.paths!r} matches no files; give globs such as 'corpus/**/*.txt'.")
    dirs = {name: shards.version_dir(data_dir, name) for name in (d.name, d.name + shards.TOKENS_SUFFIX)}
    text_key = d.text_key if d.format == "text" else chat.fields(d.format)
    for name, directory in dirs.items():  # first: no other setting (the held-out share, say) fixes a format
        split.check_recorded_format(name, directory, text_key)
    rule = split.settled_rule(list(dirs.values()), d.validation_fraction)
    record = split.made_from(files, text_key, rule)
    tokenizer = (load_tokenizer(d), made_with(d)) if d.tokenized else None
    arguments = None if workers <= 1 and not beam_options else work.beam_arguments(workers, beam_options)
    with publishing.one_builder(data_dir, d.name, say):
        publishing.set_aside_unfinished(dirs, say)
        missing = [name for name in wanted if not (dirs[name] / "dataset_info.json").exists()]
        for name in set(wanted) - set(missing):
            split.check_made_from(str(dirs[name]), record, d.paths, name)
            if name.endswith(shards.TOKENS_SUFFIX):
                split.check_made_with(str(dirs[name]), tokenizer[1])
        if not missing:
            return
        for f in files:
            inputs.check_text_key(f.path, d.text_key, d.format)
        runner = work.runner_name(arguments) if arguments is not None else "this process"
        if arguments is not None:
            work.check_runner(runner)
        remote_runner = runner not in ("this process", "DirectRunner")
        if remote_runner and not is_remote(data_dir):
            raise ConfigError(
                f"the Beam runner {runner} runs on other machines, which cannot write data.data_dir={data_dir}; "
                "give a bucket (gs://...) they all reach."
            )
        if runner == "DirectRunner":
            runner = f"Beam's DirectRunner with {workers} processes"
        _build(d, data_dir, files, rule, record, tokenizer, missing, dirs, arguments, runner, remote_runner, say)


def _build(d, data_dir, files, rule, record, tokenizer, missing, dirs, arguments, runner, remote_runner, say) -> None:
    if is_remote(data_dir):
        try:
            try_writing(data_dir)
        except OSError as e:
            raise ConfigError(
                f"cannot write the corpus into data.data_dir={data_dir} ({e}); give a bucket this machine may write."
            ) from e
    units = work.units_of(files)
    with publishing.staging(data_dir, d.name, remote_runner) as staging:
        tokenizing = any(name.endswith(shards.TOKENS_SUFFIX) for name in missing)
        # Conversations are rendered as they are prepared, so a row the template cannot render is named now.
        rendering = tokenizing or d.format != "text"
        plan = work.Plan(
            text_key=d.text_key, rule=rule, targets=tuple((name, f"{staging}/{name}") for name in missing),
            tokenizer=(d.tokenizer, d.tokenizer_path, d.chat_template) if rendering else None,
            units=len(units), reports=f"{staging}/reports", format=d.format, loss_on=d.loss_on,
        )  # fmt: skip
        total = sum(u.size for u in units)
        what = " and its tokenised store" if len(missing) > 1 else " (its tokenised store)" * tokenizing
        say(
            f"preparing {d.name}{what} from {len(files):,} files, {total / 1e6:,.1f} MB, in {len(units)} "
            f"unit{'s' * (len(units) > 1)} on {runner}"
        )
        progress = Progress(plan.reports, d.name, total, say)
        progress.start()
        started = time.monotonic()
        try:
            work.run(units, plan, arguments)
        finally:
            progress.stop()
        lengths = _lengths(plan)
        split.check_both_sides({s: sum(lengths[missing[0]][s][0]) for s in shards.SPLITS}, rule, d.paths)
        for name in missing:
            shard_lengths = {s: lengths[name][s][0] for s in shards.SPLITS}
            sizes = {s: sum(lengths[name][s][1]) for s in shards.SPLITS}
            publishing.publish(f"{staging}/{name}", str(dirs[name]), name, shard_lengths, sizes, record,
                               tokenizer[1] if name.endswith(shards.TOKENS_SUFFIX) else None, say)  # fmt: skip
        say(progress.line().replace("preparing", "prepared", 1).split("; ")[0]
            + f" in {time.monotonic() - started:.1f} s into {data_dir}")  # fmt: skip


def _lengths(plan: work.Plan) -> dict[str, dict[str, tuple[list[int], list[int]]]]:
    """{dataset: {split: (each shard's examples, each shard's bytes)}} from the units' final reports."""
    reports = sorted((r for r in work.read_reports(plan.reports) if r.get("done")),
                     key=lambda r: r["unit"])  # fmt: skip
    if len(reports) != plan.units:
        raise RuntimeError(f"{plan.units - len(reports)} of {plan.units} units reported no result")
    out = {}
    for name, _ in plan.targets:
        out[name] = {
            s: ([r["shards"][f"{name}/{s}"][0] for r in reports], [r["shards"][f"{name}/{s}"][1] for r in reports])
            for s in shards.SPLITS
        }
    return out
