"""Distillation's teacher (distill.teacher, trainer/objectives/distill.py): a run's workdir, or what
convert_hf.py import wrote, read as the model it holds and built on the student's mesh.

The teacher may be another size or family than the student; it must read the same tokens (the same
vocabulary and kind of tokenizer). Its model is its own run's model.* (a LoRA run's is its base with the
adapters folded in, as checkpoint.init_from reads one); everything else (mesh, precision, batch) is the
student's, so that its parameters are sharded by their own logical axes over the same devices. Its weights
are read once at the start, held beside the state with no optimiser state, and pinned in the run's
config.json as DIR@STEP, so a resumed run learns from the same teacher.
"""

from __future__ import annotations

import json
import os

from parallelism.accelerators import stderr_held_back
from trainer.config.errors import ConfigError
from trainer.config.forms import flatten, from_dict, to_json, with_changes
from trainer.data import run_tokenizer
from trainer.data.tokenizers import digest
from trainer.storage import workdir as wd


def parse(text: str) -> tuple[str, int | None]:
    """'DIR' or 'DIR@STEP' -> (DIR, STEP or None)."""
    path, _, step = text.rpartition("@") if "@" in text else (text, "", "")
    if step and not step.isdigit():
        raise ConfigError(f"distill.teacher={text!r} must be DIR or DIR@STEP with STEP a number.")
    return path, int(step) if step else None


def teacher_config(cfg):
    """The config the teacher is built from (None without distill.teacher): the student's, with the teacher
    run's model.* and checkpoint.init_from its weights, DIR@STEP. Refuses, in one sentence each, a teacher
    that is not there, holds no checkpoint, or reads other tokens."""
    given = cfg.distill.teacher
    if not given:
        return None
    path, step = parse(given)
    if not wd.path(path).exists():
        raise ConfigError(f"distill.teacher={given!r}: {path} does not exist; give a run's workdir or the output "
                          "of scripts/convert_hf.py import.")  # fmt: skip
    saved = wd.saved_config(path)
    if saved is None:
        raise ConfigError(f"distill.teacher={given!r}: {path} has no config.json, so it is not a run's workdir nor "
                          "an import's; give one of those.")  # fmt: skip
    steps = wd.saved_steps(path) if wd.path(wd.checkpoint_dir(path)).is_dir() else []
    if not steps:
        raise ConfigError(f"distill.teacher={given!r}: {path} holds no checkpoint; train the teacher there first "
                          "(or import one with scripts/convert_hf.py import).")  # fmt: skip
    if step is not None and step not in steps:
        raise ConfigError(f"distill.teacher={given!r}: {path} has no checkpoint at step {step}; it has {steps}.")
    theirs = from_dict(saved)
    recorded = run_tokenizer.recorded_digest(path)
    mine = (cfg.model.vocab_size, cfg.data.tokenizer, digest(cfg.data))
    other = (theirs.model.vocab_size, theirs.data.tokenizer, digest(theirs.data) if recorded is None else recorded)
    if mine != other:
        said = lambda c, v: f"model.vocab_size={v}, data.tokenizer={c.data.tokenizer} {c.data.tokenizer_path!r}"  # noqa: E731
        raise ConfigError(f"distill.teacher={given!r} reads other tokens ({said(theirs, other[0])}) than the "
                          f"student ({said(cfg, mine[0])}); distillation compares their distributions token by "
                          "token: give a teacher with the student's tokenizer.")  # fmt: skip
    model = {k: v for k, v in flatten(theirs).items() if k.startswith("model.")}
    return with_changes(cfg, {**model, "model.lora.rank": 0, "model.lora.base": "", "model.max_seq_len":
                              cfg.model.max_seq_len, "checkpoint.init_from": f"{path}@{step or steps[-1]}",
                              "distill.teacher": ""})  # fmt: skip


def pinned(cfg, workdir: str):
    """`cfg` with the teacher a resumed run pinned at its start (its config.json's DIR@STEP); a run that
    started with another teacher is refused, as another teacher would change what it learns mid-run."""
    saved = wd.saved_config(workdir)
    kept = from_dict(saved).distill.teacher if saved is not None and wd.saved_steps(workdir) else ""
    if not kept or not cfg.distill.teacher:
        return cfg
    path, step = parse(cfg.distill.teacher)
    if path != parse(kept)[0] or step not in (None, parse(kept)[1]):
        raise ConfigError(f"distill.teacher={cfg.distill.teacher!r}: this run distils from {kept}, pinned at its "
                          "start; resume it with that teacher, or start a new run (another --workdir).")  # fmt: skip
    return with_changes(cfg, {"distill.teacher": kept})


# A process's teacher for writing logits, made once: {the config's JSON: (jitted scorer, its parameters)}.
_SCORERS: dict = {}


def write_logits(cfg, workers: int = 1, beam_options: str = "", say=print) -> str:
    """Write the teacher's top-k logits for every training window of `cfg`'s run (distill.mode=offline;
    trainer/data/teacher_logits.py): rows not yet written, in this process, or as an Apache Beam pipeline
    (`workers` processes of Beam's DirectRunner, or `beam_options` for any runner), a row a unit; a progress
    line every 30 seconds. Returns the folder. Logits of another run already in the folder are refused, and
    nothing there is overwritten."""
    from trainer.data import streams, teacher_logits
    from trainer.data.preparation import work

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
    import jax
    import numpy as np

    from trainer.data import streams, teacher_logits
    from trainer.training.resume import load_init_params
    from trainer.training.setup import build

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
    iterator = iter(streams.batches(streams.Stream.from_config(cfg), cfg.data.train_split, [row], shuffle=True))
    windows = [next(iterator) for _ in range(cfg.train.steps)]
    stacked = {k: np.concatenate([w[k] for w in windows]) for k in ("tokens", "positions", "segment_ids")}
    teacher_logits.write_row(row, folder, stacked, lambda *batch: score(params, *batch))
