"""Before a run compiles anything: every check that can refuse it, then the workdir made and the run's
tokenizer stored. A refusal here leaves the workdir as it was (trainer/run/loop.py trains)."""

from __future__ import annotations

import dataclasses
import uuid

import jax

from parallelism.distributed import barrier, first_process_says
from trainer.config.forms import with_changes
from trainer.data import corpora, prompts, run_tokenizer, streams
from trainer.data.tokenizers import load_tokenizer
from trainer.evaluation import samples
from trainer.interop import harness
from trainer.run import elastic
from trainer.storage import local_tier
from trainer.storage import workdir as wd
from trainer.storage.lease import Lease
from trainer.storage.metrics import check_fresh_start
from trainer.training import batch_ramp, resume, sdc, teacher
from trainer.training.setup import Setup, build
from trainer.training.validation import unread_settings


def prepare_run(cfg, workdir: str) -> tuple[Setup, tuple | None, tuple, str, Lease | None]:
    """Every check that can fail, before anything is compiled; the workdir is created last.

    Returns the setup (whose config reads the run's copy of its tokenizer, trainer/data/run_tokenizer.py),
    for a new run with `checkpoint.init_from` the weights to start from, and the train step's inputs after
    the batch (DPO's reference weights; its config then pins init_from to DIR@STEP), and the run's identity
    (written to the workdir with its config, once a checkpoint is accepted: trainer/run/loop.py), and the
    workdir's lease (process 0's; trainer/storage/lease.py), which the caller releases.
    """
    primary = jax.process_index() == 0
    say = print if primary else _quiet
    cfg = elastic.keep_global_batch(cfg, say)  # relaunched on fewer hosts: the same batch by accumulation
    setup = build(cfg)
    sdc.check(cfg, setup.mesh.devices.flat[0].platform)
    for line in unread_settings(cfg):
        say(f"warning: {line}", flush=True)
    wd.wait_for_storage(workdir, cfg.checkpoint.retry_seconds, say)
    settled = batch_ramp.settled(cfg, workdir, say)  # another global batch on a resume
    if settled is not cfg:
        cfg, setup = settled, build(settled)
    # A resumed run learns from the teacher it started with (the same directory: the model built above).
    cfg = teacher.pinned(cfg, workdir)
    cfg = run_tokenizer.settle(cfg, workdir)
    if primary:  # the other hosts may not hold the tokenizer yet: they read the run's copy, made below
        corpora.check_vocab(cfg)
        if cfg.train.sample_prompts:
            samples.check_prompts(cfg, load_tokenizer(cfg.data))
    if cfg.train.harness_tasks:  # the harness installed, its tasks known and their data in reach (every host)
        harness.load().check(cfg)
    if cfg.data.source != "synthetic":
        wd.wait_for_storage(corpora.data_dir(cfg.data), cfg.checkpoint.retry_seconds, say, "data.data_dir")
        if primary:
            corpora.prepare(cfg.data)
        barrier("dataset prepared")
        splits = [cfg.data.train_split] + ([cfg.data.eval_split] if cfg.train.eval_every else [])
        corpora.check_every_host_reads_it(cfg.data, splits)
        if cfg.data.format == "prompts":  # every prompt of every split the run reads leaves room for its completion
            for split in splits:
                prompts.check_room(streams.Stream.from_config(cfg), split, cfg.rl.max_new_tokens)
    init, inputs = None, ()
    if wd.saved_steps(workdir):
        resume.check_resume(workdir, cfg, setup)
    else:
        check_fresh_start(workdir, cfg)
        if cfg.checkpoint.init_from:
            init = resume.load_init_params(cfg, setup)
    rl_reference = cfg.data.format == "prompts" and cfg.rl.beta > 0  # GRPO's KL pulls towards it
    if setup.preference or setup.adapted or rl_reference:  # the reference, or the frozen base: pinned at the start
        reference, pinned = resume.load_reference(cfg, setup, workdir, init)
        inputs, cfg = (reference,), with_changes(cfg, {"checkpoint.init_from": pinned})
    if cfg.distill.teacher:  # pinned as DIR@STEP; an online teacher's weights are the step's last input
        taught = teacher.teacher_config(cfg)
        cfg = with_changes(cfg, {"distill.teacher": taught.checkpoint.init_from})
        if setup.teacher is not None:
            inputs += (resume.load_init_params(taught, setup.teacher)[0],)
        streams.Stream.from_config(cfg).with_teacher_logits(cfg)  # offline: the logits are this run's
    # The run's identity: its workdir's, or a new one (a new run, or its workdir deleted and made again),
    # which no local checkpoint of an earlier run carries; the same on every process (process 0's).
    run = first_process_says(bytes.fromhex(wd.run_id(workdir) or uuid.uuid4().hex)).hex()
    if cfg.checkpoint.local_dir:  # before the workdir is made: a refusal leaves it as it was
        local_tier.check_writable(cfg.checkpoint.local_dir, workdir, run)
    wd.check_writable(workdir)
    lease = Lease.take(workdir) if primary else None  # a second launch of this run is refused here
    try:
        return _stored(cfg, workdir, setup, primary, say), init, inputs, run, lease
    except BaseException:
        if lease is not None:
            lease.release()
        raise


def _stored(cfg, workdir: str, setup, primary: bool, say):
    """The run's copy of its tokenizer, made once the workdir's lease is held; the setup that reads it."""
    devices = setup.mesh.devices.size
    if setup.mesh.devices.flat[0].platform == "cpu":  # said once: the plugins' own words are held back
        say(f"running on the CPU ({devices} device{'s' * (devices > 1)}): no GPU or TPU is in use")
    if primary:
        run_tokenizer.store(cfg, workdir)
    barrier("tokenizer stored")
    return dataclasses.replace(setup, cfg=run_tokenizer.use_copy(cfg, workdir))


def _quiet(*_args, **_kwargs) -> None:
    pass
