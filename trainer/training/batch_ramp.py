"""How many sequences each step reads: the global batch, or less early on (a batch-size ramp), and a global
batch changed on a resume.

Early in training small batches are as good per token as large ones and cost
fewer tokens per update. With `train.ramp_batch_size` > 0 the batch grows in
powers of two from that size to `global_batch_size` over `train.ramp_tokens`
tokens (a stage is the largest power-of-two multiple of the start not above
the linear target). The learning-rate schedule counts sequences, so the ramp
does not move it: step s of the schedule is always s full batches' worth.

Sizes follow the sequences read from the data stream, so the loop can read
batches ahead (a skipped step reads data too). A run reads exactly
`train.steps` global batches' worth of sequences unless steps are skipped; the
last steps of a ramped run take what is left, in halves of a stage, so every
step's size divides the global batch (see streams.ramp_rows).

A resumed run may change train.global_batch_size. Its data keeps the document
streams it was read through (data.stream_rows, set to the run's own by
`settled`), so no document is read twice or skipped: a batch of a fraction of
them reads each in turn, a multiple reads consecutive windows of each
(streams.step_rows). train.steps and the schedule go on counting batches of the
stream's rows, so the run's length and its learning rate stay in tokens.
"""

from __future__ import annotations

import math

from trainer.config import microbatch_size, stream_rows
from trainer.config.errors import ConfigError
from trainer.config.forms import from_dict, with_changes
from trainer.data import streams
from trainer.storage import workdir as wd


def check(cfg) -> None:
    t = cfg.train
    rows = stream_rows(cfg)
    if rows != t.global_batch_size:
        if rows % t.global_batch_size and t.global_batch_size % rows:
            near = sorted({rows // k for k in range(1, rows + 1) if rows % k == 0} | {rows * 2, rows * 4})
            near = sorted(near, key=lambda b: abs(b - t.global_batch_size))[:3]
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} cannot read this run's {rows} document streams "
                f"(data.stream_rows) evenly: it must divide {rows} or be a multiple of it, e.g. "
                f"{', '.join(map(str, sorted(near)))}."
            )
        refused = [key for key, on in (("train.ramp_batch_size", t.ramp_batch_size),
                                        ("offline distillation", cfg.distill.teacher and cfg.distill.mode == "offline"),
                                        ("data.format=prompts", cfg.data.format == "prompts")) if on]  # fmt: skip
        if refused:
            raise ConfigError(
                f"{refused[0]} reads one batch row per document stream, so its global batch cannot change on a "
                f"resume ({rows} streams, train.global_batch_size={t.global_batch_size}); resume with "
                f"--config.train.global_batch_size={rows}."
            )
    if not t.ramp_batch_size:
        return
    micro, ratio = microbatch_size(cfg), t.global_batch_size / t.ramp_batch_size
    if (
        t.ramp_batch_size % micro
        or not micro <= t.ramp_batch_size < t.global_batch_size
        or ratio != 2 ** round(math.log2(ratio))
    ):
        raise ConfigError(
            f"train.ramp_batch_size={t.ramp_batch_size} must be a multiple of the microbatch ({micro} sequences) "
            f"and train.global_batch_size={t.global_batch_size} divided by a power of two."
        )
    if t.ramp_tokens <= 0:
        raise ConfigError("train.ramp_tokens must be positive when train.ramp_batch_size is set.")


def step_size(cfg, read: int) -> int:
    """Sequences the next step reads, given how many sequences have been read from the stream."""
    t = cfg.train
    size = t.global_batch_size
    if t.ramp_batch_size:
        start = t.ramp_batch_size
        ramp = t.ramp_tokens / cfg.data.seq_len  # in sequences
        linear = start + (size - start) * min(1.0, read / ramp)
        size = min(size, start * 2 ** int(math.floor(math.log2(linear / start) + 1e-9)))
    left = t.steps * stream_rows(cfg) - read
    while size > left > 0:
        size //= 2
    return size


def settled(cfg, workdir: str, say) -> object:
    """The config a launch runs: as given, or, resuming a run whose checkpoints were read through another number
    of document streams than this global batch, with data.stream_rows set to the run's own (said once)."""
    saved = wd.saved_config(workdir)
    if saved is None or cfg.data.stream_rows or not wd.saved_steps(workdir):
        return cfg
    then = from_dict(saved)
    rows = stream_rows(then)
    if rows == cfg.train.global_batch_size:
        return cfg
    changed = with_changes(cfg, {"data.stream_rows": rows})
    b = cfg.train.global_batch_size
    how = f"each step reads {b} of them in turn" if b < rows else f"each step reads {b // rows} windows of each"
    say(f"train.global_batch_size: {then.train.global_batch_size} there, {b} here: the data keeps the run's {rows} "
        f"document streams ({how}), so no document is read twice or skipped; train.steps and the schedule count "
        f"batches of {rows} sequences, so the run's length and learning rate go on in tokens")  # fmt: skip
    return changed


def check_left(cfg, workdir: str, read: int) -> None:
    """Refuse a global batch that does not divide the sequences left to read (after `read`) of the run's length."""
    t, rows = cfg.train, stream_rows(cfg)
    left = t.steps * rows - read
    if t.ramp_batch_size or left <= 0 or left % t.global_batch_size == 0:
        return
    more = (-(left // rows)) % max(t.global_batch_size // rows, 1)
    raise ConfigError(
        f"{workdir} has {left} sequences left to read (train.steps={t.steps} batches of {rows}), which "
        f"train.global_batch_size={t.global_batch_size} does not divide; resume with a train.steps that leaves a "
        f"multiple of it, e.g. {t.steps + more}."
    )


def plan(cfg, positions: list[int], sharding, read: int) -> tuple[int, list[int]]:
    """(sequences in the step starting `read` sequences into the stream, the stream rows this process reads for
    it): `positions` are its rows of a full batch, laid out by `sharding`."""
    size, batch = step_size(cfg, read), cfg.train.global_batch_size
    if size == batch:
        return size, streams.step_rows(positions, size, stream_rows(cfg), read)
    mine = streams.process_rows(sharding, size, cfg.data.seq_len)  # a ramp's few sizes
    return size, streams.ramp_rows(mine, size, batch)
