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

import os

from trainer.config.errors import ConfigError
from trainer.config.forms import flatten, from_dict, with_changes
from trainer.data import run_tokenizer
from trainer.storage import workdir as wd
from trainer.storage.metrics import read_records


def parse(text: str) -> tuple[str, int | None]:
    """distill.teacher's 'DIR' or 'DIR@STEP' -> (DIR, STEP or None)."""
    return wd.at_step(text, "distill.teacher")


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
    run_tokenizer.check_same_tokens(cfg, path, theirs, f"distill.teacher={given!r}", "the student",
                                    "distillation compares their distributions token by token: give a teacher with "
                                    "the student's tokenizer")  # fmt: skip
    model = {k: v for k, v in flatten(theirs).items() if k.startswith("model.")}
    return with_changes(cfg, {**model, "model.lora.rank": 0, "model.lora.base": "", "model.max_seq_len":
                              cfg.model.max_seq_len, "checkpoint.init_from": f"{path}@{step or steps[-1]}",
                              "distill.teacher": ""})  # fmt: skip


def pinned(cfg, workdir: str):
    """`cfg` with the teacher a resumed run pinned at its start (its config.json's DIR@STEP); a run that
    started with another teacher is refused, as another teacher would change what it learns mid-run."""
    if not cfg.distill.teacher:
        return cfg
    saved = wd.saved_config(workdir)
    kept = from_dict(saved).distill.teacher if saved is not None and wd.saved_steps(workdir) else ""
    if not kept:
        return cfg
    path, step = parse(cfg.distill.teacher)
    if path != parse(kept)[0] or step not in (None, parse(kept)[1]):
        raise ConfigError(f"distill.teacher={cfg.distill.teacher!r}: this run distils from {kept}, pinned at its "
                          "start; resume it with that teacher, or start a new run (another --workdir).")  # fmt: skip
    return with_changes(cfg, {"distill.teacher": kept})


# What makes two runs the same student: a distilled run and one of these equal but for distill.* (and where
# they wrote) trained the same model on the same data and schedule.
STUDENT = (
    "model.",
    "data.",
    "optim.",
    "precision.",
    "train.global_batch_size",
    "train.steps",
    "train.seed",
    "train.eval_batches",
    "checkpoint.init_from",
)


def untaught(cfg, workdir: str, step: int) -> dict:
    """The same student trained without a teacher, where such a run sits beside `workdir` (a sibling folder on
    a local disk) with a held-out loss at `step`: {"eval_loss_alone", "alone"}, else {}."""
    if wd.is_remote(workdir):
        return {}
    ours, here = flatten(cfg), os.path.abspath(workdir)
    parent = os.path.dirname(here)
    for name in sorted(os.listdir(parent)):
        other = os.path.join(parent, name)
        saved = wd.saved_config(other) if other != here and os.path.isdir(other) else None
        if saved is None:
            continue
        theirs = flatten(from_dict(saved))
        same = all(theirs.get(k) == v for k, v in ours.items() if k.startswith(STUDENT))
        if not same or theirs.get("distill.teacher"):
            continue
        scored = [r for r in read_records(other) or [] if r.get("step") == step and "eval_loss" in r]
        if scored:
            return {"eval_loss_alone": scored[-1]["eval_loss"], "alone": other}
    return {}
