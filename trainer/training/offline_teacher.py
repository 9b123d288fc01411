"""Offline distillation's teacher, run ahead of training: its top-k logits of every window a run will train
on, written beside the corpus (trainer/data/teacher_logits.py has their format and how training reads them;
scripts/teacher_logits.py is the command)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from parallelism.accelerators import stderr_held_back
from trainer.config.errors import ConfigError
from trainer.config.forms import from_dict, to_json, with_changes
from trainer.data import streams, teacher_logits
from trainer.data.preparation import work
from trainer.storage import workdir as wd
from trainer.training.resume import load_init_params
from trainer.training.setup import build
from trainer.training.teacher import teacher_config

# A process's teacher for writing logits, made once: {the config's JSON: (jitted scorer, its parameters)}.
_SCORERS: dict = {}


def write_logits(cfg, workers: int = 1, beam_options: str = "", say=print) -> str:
    """Write the teacher's top-k logits for every training window of `cfg`'s run (distill.mode=offline;
    trainer/data/teacher_logits.py): rows not yet written, in this process, or as an Apache Beam pipeline
    (`workers` processes of Beam's DirectRunner, or `beam_options` for any runner), a row a unit; a progress
    line every 30 seconds. Returns the folder. Logits of another run already in the folder are refused, and
    nothing there is overwritten."""
    taught = teacher_config(cfg)
    if taught is None:
        raise ConfigError("scripts/teacher_logits.py writes a teacher's logits: set distill.teacher (and "
                          "distill.mode=offline, distill.top_k).")  # fmt: skip
    cfg = with_changes(cfg, {"distill.teacher": taught.checkpoint.init_from, "distill.mode": "offline"})
    identity = streams.Stream.from_config(cfg).identity()
    folder, wanted = teacher_logits.location(cfg, identity), teacher_logits.manifest(cfg, identity)
    manifest = wd.path(folder) / teacher_logits.MANIFEST
    if manifest.exists():  # a run's logits, being finished, or a longer run's, which this one reads the start of
        made = json.loads(manifest.read_text())
        if {**made, "windows": wanted["windows"]} != wanted or made["windows"] < wanted["windows"]:
            raise ConfigError(f"{folder} holds teacher logits made for another run (its {teacher_logits.MANIFEST}"
                              f", {made['windows']} steps); give this one another distill.logits_dir.")  # fmt: skip
        cfg, wanted = with_changes(cfg, {"train.steps": made["windows"]}), made
    arguments = None if workers == 1 and not beam_options else work.beam_arguments(workers, beam_options)
    if arguments is not None:
        work.check_runner(work.runner_name(arguments))
    os.makedirs(os.path.join(folder, teacher_logits.ROWS), exist_ok=True)
    wd.write_file(manifest, json.dumps(wanted, indent=2))
    rows = teacher_logits.missing_rows(folder, cfg.train.global_batch_size)
    progress = teacher_logits.Progress(folder, cfg.train.global_batch_size, say)
    progress.start()
    try:
        settings = to_json(cfg)
        if arguments is None:
            for row in rows:
                write_row(row, settings, folder)
        else:
            import apache_beam as beam
            from apache_beam.options.pipeline_options import PipelineOptions

            with stderr_held_back(), beam.Pipeline(options=PipelineOptions(arguments)) as pipeline:
                _ = (pipeline | "rows" >> beam.Create(rows) | "spread" >> beam.Reshuffle()
                     | "score" >> beam.Map(write_row, settings, folder))  # fmt: skip
    finally:
        progress.stop()
    say(progress.line())
    return folder


def write_row(row: int, settings: str, folder: str) -> None:
    """Row `row`'s logits (the run of config JSON `settings`), its windows read as training reads them and
    scored by the teacher on this process's first device."""
    cfg = from_dict(json.loads(settings))
    if settings not in _SCORERS:
        single = {f"mesh.{axis}": 1 for axis in ("data", "fsdp", "tensor", "expert", "context", "stage")}
        taught = with_changes(teacher_config(cfg), single)
        setup = build(taught, jax.devices()[:1])
        params = load_init_params(taught, setup)[0]
        model, k = setup.inference_model, cfg.distill.top_k

        @jax.jit
        def score(params, tokens, positions, segment_ids):
            logits = model.apply(params, tokens, positions, segment_ids)
            values, ids = jax.lax.top_k(logits, k)
            return ids.astype(np.int32), values.astype(np.float32)

        _SCORERS[settings] = (score, params)
    score, params = _SCORERS[settings]
    windows = iter(streams.batches(streams.Stream.from_config(cfg), cfg.data.train_split, [row], shuffle=True))
    teacher_logits.write_row(row, folder, windows, cfg.train.steps, lambda *batch: score(params, *batch))
