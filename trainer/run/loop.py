"""The training loop: restore or initialise, step, log, evaluate, checkpoint, recover.

The host never makes the device wait. Batches are read a few steps ahead in a
background thread (streams.prefetch, Grain's); a log point's metrics are fetched only
after the next step has been dispatched, so the device has work queued while
the host writes them. Step time is wall time between two log points,
evaluation and checkpoint time excluded. Log points are also where the loop
reads the device's stability counters and, if the run is in trouble, rolls
back (trainer/training/stability.py, trainer/run/rollback.py).

The run ends when `train.steps` full batches have been trained on: skipped
steps and a batch-size ramp make that more steps than `train.steps`.
SIGTERM (preemption) finishes the step in flight, saves a checkpoint at it and
returns; the same command later resumes from there. With several processes
they stop together, at a step the runtime agrees (trainer/run/preemption.py);
a process that dies ends the others, naming it (parallelism/distributed.py).
"""

from __future__ import annotations

import contextlib
import functools
import time

import jax
import numpy as np

from parallelism.distributed import fetch, wait_if_a_process_died
from trainer.config import microbatch_size, stream_rows
from trainer.data import corpora, streams, workers
from trainer.data.mixture import mixture_shares
from trainer.data.tokenizers import load_tokenizer
from trainer.evaluation import samples
from trainer.evaluation.loss import Evaluator, eval_line
from trainer.interop import harness
from trainer.model.flops import peak_flops
from trainer.run import elastic, preflight, startup
from trainer.run.hang import HangWatch
from trainer.run.preemption import NAMES, watch_for_sigterm
from trainer.run.profiling import StepProfiler
from trainer.run.programs import StepPrograms
from trainer.run.rollback import roll_back, rollback_event
from trainer.storage import compile_cache
from trainer.storage import workdir as wd
from trainer.storage.checkpoint import Checkpointer
from trainer.storage.goodput import Goodput
from trainer.storage.local_tier import LocalTier
from trainer.storage.metrics import MetricsWriter, console_line, floats, read_records
from trainer.training import batch_ramp, clock, resume, rollouts, sdc, stability, teacher
from trainer.training.setup import Setup
from trainer.training.student_samples import StudentSamples


def train(cfg, workdir: str) -> dict:
    """Train, or resume from the newest readable checkpoint in `workdir`; returns the last logged values."""
    account = Goodput()  # the launch's clock starts here: its checks and start-up are timed too
    startup.launch_begins()
    compile_cache.use(compile_cache.place(cfg.train.compile_cache, workdir))
    setup, init, inputs, identity, lease = preflight.prepare_run(cfg, workdir)
    try:
        return _train(setup, workdir, init, account, inputs, identity)
    finally:
        if lease is not None:
            lease.release()


def _train(setup, workdir: str, init, account: Goodput, inputs: tuple, identity: str) -> dict:
    cfg = setup.cfg
    startup.mark("checks")
    run = Run(setup.cfg, workdir, setup, init, account, inputs, identity)
    try:
        if run.finished():
            run.say(f"already trained to step {run.step}; raise train.steps to go on")
            return {"step": run.step}
        run.start()
        with watch_for_sigterm() as stop:
            pending = None  # a log point's metrics, fetched once the next step is dispatched
            while not stop.poll() and (pending or not run.finished()):
                metrics = None if run.finished() else run.take_step()
                if pending:
                    trouble, pending = run.log(*pending), None
                    if trouble:  # the step just dispatched is dropped with the rest
                        run.roll_back(trouble)
                        continue
                if metrics is not None:
                    if run.step % cfg.train.log_every == 0 or run.trained >= run.target:
                        pending = (run.step, metrics)
                    run.evaluate_and_save(force_save=stop.requested)
            if pending:
                run.log(*pending)
            if stop.requested:
                run.save_now()
                # Every process says it: on a pod each host's log is read on its own.
                who = NAMES[stop.signal] if not stop.together else f"a preemption notice (process {run.process})"
                print(f"stopping on {who}: checkpoint saved at step {run.step}; rerun the same command to resume",
                      flush=True)  # fmt: skip
                run.last["preempted"] = True
    except Exception as e:
        wait_if_a_process_died(e)  # with a process gone, closing would wait on it (the last save's commit)
        raise
    finally:
        run.close()
    if cfg.distill.teacher and "eval_loss" in run.last and not run.last.get("preempted"):
        run.last.update(teacher.untaught(cfg, workdir, run.step))  # done: says whether the student gained
    run.say(account.summary())
    return {"step": run.step, **run.last}


class Run:
    """One training run's moving parts, so that train() reads as the loop it is."""

    def __init__(self, cfg, workdir: str, setup: Setup, init: tuple | None = None, account: Goodput | None = None,
                 inputs: tuple = (), identity: str = ""):  # fmt: skip
        """Everything it opens (threads, worker processes, the checkpoint manager, the bucket copier) is
        closed again if a later part of the start-up fails: a long-lived process (the scaling sweep trains
        many runs in one) keeps nothing of a run that did not start."""
        self.ckpt = self.local = self.data = self.row_batches = self.workers = None
        self.files = self.writer = self.profiler = self.hang = None
        self.goodput = account or Goodput()
        self.inputs, self.identity = inputs, identity  # the step's inputs after the batch; the run's identity
        try:
            self._open(cfg, workdir, setup, init)
        except BaseException:
            self.close()
            raise

    def _open(self, cfg, workdir: str, setup: Setup, init: tuple | None) -> None:
        self.cfg, self.setup, self.workdir = cfg, setup, workdir
        self.process = jax.process_index()
        self.primary = self.process == 0
        self.say = print if self.primary else (lambda *a, **k: None)
        saved_cfg = resume.saved_config(workdir)
        t = cfg.train
        self.batch, self.micro = t.global_batch_size, microbatch_size(cfg)
        self.unit = stream_rows(cfg)  # what train.steps and the schedule count batches of (batch_ramp.py)
        self.target = t.steps * self.unit  # sequences to train on
        self.stream = streams.Stream.from_config(cfg).with_teacher_logits(cfg)
        self.rows = streams.process_rows(setup.batch_sharding, self.batch, cfg.data.seq_len)  # this process's
        self.stream_rows = streams.rows_read(self.rows, self.batch, self.unit)  # the document streams it reads
        self.rl = cfg.data.format == "prompts"  # batches sampled from the policy (trainer/training/rollouts.py)
        self.reference = None
        if self.rl and not setup.adapted:  # GRPO's reference scores the rollouts; the step takes no inputs
            self.reference, self.inputs = (self.inputs or (None,))[0], ()
        # First: held-out batches that score nothing are refused before a checkpoint is read or config written.
        held_out = (lambda: rollouts.HeldOut(setup, self.stream, t.eval_batches)) if self.rl else (
            lambda: Evaluator(setup, self.rows, self.inputs))  # fmt: skip
        self.evaluator = held_out() if t.eval_every else None
        self.ckpt = Checkpointer(
            wd.checkpoint_dir(workdir), keep=cfg.checkpoint.keep, keep_every=cfg.checkpoint.keep_every,
            async_save=cfg.checkpoint["async"],
        )  # fmt: skip
        self.abstract = setup.abstract_state()
        c = cfg.checkpoint
        if c.local_dir:
            self.local = LocalTier(c.local_dir, workdir, self.identity, c.local_keep, c["async"], setup.mesh,
                                   cfg.to_dict())  # fmt: skip

        def restore(step: int):
            data = self._new_data()
            return (*resume.restore_state(self.ckpt, step, setup, data, saved_cfg), data)

        startup.mark("open")
        found = None if self.local is None else resume.from_local(
            self.local, max(self.ckpt.steps(), default=-1), self.abstract, workdir, cfg, setup, self._new_data,
            saved_cfg, self.say)  # fmt: skip
        self.resumed_locally = found is not None
        if found is None:
            found = self.ckpt.restore_newest_intact(restore, self.say, cfg.checkpoint.retry_seconds)
        self.resumed = found is not None
        self.state, self.reset_optimizer, self.reset_label, data = resume.starting_state(
            cfg, setup, workdir, found and found[1], init, self._new_data, self.say)  # fmt: skip
        self.step, self.trained, self.data_read, self.skipped_seen = self._clocks()  # waits for the state
        self.row_batches = data  # closed by close() from here on, should what follows refuse or fail
        if self.trained >= self.target:  # a finished run run again is no launch of it: its workdir stays as it is
            return
        batch_ramp.check_left(cfg, workdir, self.data_read)
        if self.primary:  # once the checkpoint is accepted: a refusal leaves the workdir as it was
            wd.write_config(workdir, cfg)
            if self.identity and wd.run_id(workdir) != self.identity:
                wd.write_run_id(workdir, self.identity)
        begun = "from checkpoint.init_from" if init is not None else "initialised"
        startup.mark("state", f"restored step {self.step}" if found else begun)
        if cfg.data.workers:  # the rows' reading and tokenising in processes of their own, from this state
            state = data.get_state()
            data.close()
            self.row_batches = None
            data = self.workers = workers.ProcessRows(self.stream, cfg.data.train_split, self.stream_rows, state,
                                                      shuffle=True, workers=cfg.data.workers)  # fmt: skip
        self.row_batches = data
        # A rollout samples from the weights of the step before it: nothing can be read ahead.
        plan = functools.partial(batch_ramp.plan, cfg, self.rows, setup.batch_sharding)
        self.data = data if self.rl else streams.prefetch(data, plan, self.data_read)
        self.hang = HangWatch(t.hang_seconds, lambda: self.step, workdir,
                              lambda: self.workers.stacks() if self.workers else [])  # fmt: skip
        self.files = wd.GrowingFiles(workdir) if self.primary else None
        relaunch = elastic.relaunch_event(cfg, self.goodput.open(self.files, self.step))  # hosts lost or back
        self.writer = MetricsWriter(self.files, resume_step=self.step, cfg=cfg, workdir=workdir, fresh=not self.resumed)
        if relaunch:
            self.writer.write(self.step, relaunch[0], console=relaunch[1])
        self.profiler = StepProfiler(t.profile_steps, self.files, workdir)
        self.flops_per_token = setup.flops_per_token()
        self.peak = peak_flops(setup.mesh.devices.flatten().tolist())
        self.samples = samples.Samples(setup, load_tokenizer(cfg.data)) if t.sample_prompts else None
        on_policy = cfg.distill.teacher and cfg.distill.on_policy
        self.student_samples = StudentSamples(setup) if on_policy else None
        tokens = load_tokenizer(cfg.data) if t.harness_tasks else None
        self.harness = harness.load().InLoop(setup, tokens, workdir, self.hang) if t.harness_tasks else None
        self.sampled = False
        self.programs = StepPrograms(setup, self.abstract, self.micro, self.hang, self.goodput, self.say)
        self.dispatched: list[tuple[int, int]] = []  # (step, tokens) of the steps not yet logged
        self.mixture_taken = np.zeros(len(self.stream.mixture), np.int64)
        self.bos_id = load_tokenizer(cfg.data).bos_id if cfg.data.source != "synthetic" else None
        self.mark_step, self.mark_time = self.step, time.perf_counter()
        self.last: dict = {}

    def _new_data(self):
        if self.rl:
            return rollouts.Rollouts(self.setup, self.stream, self.rows, self._policy, self.cfg.rl.beta > 0)
        return iter(streams.batches(self.stream, self.cfg.data.train_split, self.stream_rows, shuffle=True))

    def _policy(self) -> tuple:
        """(the weights the model applies now, GRPO's reference weights or None)."""
        weights = self.setup.weights(self.state.params, self.inputs)
        if not self.cfg.rl.beta:
            return weights, None
        return weights, self.setup.reference(weights, self.inputs) if self.setup.adapted else self.reference

    def _clocks(self) -> tuple[int, int, int, int]:
        """(step, sequences trained on, sequences read, skipped steps): a (small) sync with the device."""
        st = self.state.stability
        s = fetch({"step": self.state.step, **self.state.clock, "skipped": st["skipped"],
                   **{k: st[f"rerun_{k}"] for k in ("transient", "persistent")}})  # fmt: skip
        self.reruns_seen = {k: int(s[k]) for k in ("transient", "persistent")}
        trained, read = (clock.value(s[k], self.unit) for k in ("sequences", "data_read"))
        return int(s["step"]), trained, read, int(s["skipped"])

    def finished(self) -> bool:
        if self.trained >= self.target:  # an estimate between syncs: a skipped step trains on nothing
            self.step, self.trained, self.data_read, self.skipped_seen = self._clocks()
        return self.trained >= self.target

    def start(self) -> None:
        cfg, setup = self.cfg, self.setup
        if self.resumed and not self.resumed_locally:  # the local tier says where it resumed itself
            fresh = f" with a fresh {cfg.optim.name} optimiser state (checkpoint.reset_optimizer)"
            self.say(f"resumed from the checkpoint at step {self.step}{fresh if self.reset_optimizer else ''}")
        for line in setup.describe(self.flops_per_token):
            self.say(line)
        self.say(corpora.describe(cfg.data))
        if self.rl and self.evaluator is not None:  # GRPO: where the held-out reward starts, for done: and the report
            self.last.update(self._scored_before())
        startup.mark("loop")
        self._step_fn(batch_ramp.step_size(cfg, self.data_read))
        self.goodput.enter("step")
        self._mark()

    def _scored_before(self) -> dict:
        """The held-out figures at step 0 as `<name>_before`: scored now and logged at step 0 on a fresh run, read
        back from the metrics on a resumed one (none if its first launch did not score them)."""
        if self.resumed:
            result = next((r for r in read_records(self.workdir) or [] if r["step"] == 0 and "eval_reward" in r), {})
        else:
            with self.goodput.phase("eval"):
                result = self.evaluator(self.setup.weights(self.state.params, self.inputs), self.hang.progress)
            self.writer.write(0, result, console=eval_line(0, result))
        return {f"{k}_before": v for k, v in result.items() if k.startswith("eval_")}

    def _step_fn(self, size: int, checked: bool = False):
        """The train step for a batch of `size` sequences (`checked`: under libtpu's checker), compiled once."""
        program, seconds = self.programs.get(size, checked)
        self.mark_time += seconds  # compiling is not training time
        return program

    def _mark(self) -> None:
        self.mark_step, self.mark_time = self.step, time.perf_counter()

    def take_step(self):
        """Dispatch one step (no waiting on the device); returns its metrics, still on the device."""
        first = startup.pending("first step")
        with self.goodput.phase("data"):
            size, local = next(self.data)
        if first:
            startup.mark("first batch")
        if "source" in local:  # a mixture: count what each corpus gave this process's rows
            self.mixture_taken += streams.mixture_counts(local, self.stream.mixture_unit, len(self.stream.mixture),
                                                         self.bos_id)  # fmt: skip
        batch = streams.to_global(local, self.setup.batch_sharding, size)
        if self.student_samples is not None:  # on-policy distillation: some steps train on the student's own text
            batch = self.student_samples(self.setup.weights(self.state.params, self.inputs), batch, self.step)
        self.profiler.before(self.step + 1)
        program = self._step_fn(size, sdc.checked(self.cfg, self.step + 1))
        self.state, metrics = program(self.state, batch, *self.inputs)
        self.step, self.trained, self.data_read = self.step + 1, self.trained + size, self.data_read + size
        traced = self.profiler.after(self.step, metrics)
        if traced:
            self.say(traced)
        self.dispatched.append((self.step, size * self.cfg.data.seq_len))
        if not self.hang.armed:  # watched once the first step has run: on a pod, once every process has compiled
            jax.block_until_ready(metrics)
        if first:
            startup.mark("first step")
            self.say(startup.line(), flush=True)
        self.hang.progress()
        return metrics

    def log(self, step: int, metrics) -> str | None:
        """Write step `step`'s metrics (and any skipped-step event); returns why to roll back, if so."""
        values = fetch(metrics)  # waits for that step only: the next one is already queued
        trained = clock.value({"batches": values.pop("sequences_batches"), "rows": values.pop("sequences_rows")},
                              self.unit)  # fmt: skip
        values = {**floats(values), "sequences": trained}
        now = time.perf_counter()  # the next interval starts here: writing this record is in it (goodput's step)
        elapsed = now - self.mark_time
        tokens = sum(n for s, n in self.dispatched if s <= step)
        self.dispatched = [(s, n) for s, n in self.dispatched if s > step]
        tokens_per_sec = tokens / elapsed
        logged = {
            **values,
            "tokens_per_sec": tokens_per_sec,
            "mfu": self.flops_per_token * tokens_per_sec / self.peak if self.peak else None,
            "step_time": elapsed / max(step - self.mark_step, 1),
            **mixture_shares(self.stream.mixture, self.mixture_taken),
            **(self.data.figures(step) if self.rl else {}),
            **self.goodput.totals(),
        }
        self.last.update(logged)  # beside the latest evaluation's figures
        console = console_line(step, values["sequences"] / self.unit, self.cfg.train.steps, logged)
        self.writer.write(step, logged, console=console)
        self.goodput.write()
        self.mark_step, self.mark_time = step, now
        skipped = int(values["skipped_total"]) - self.skipped_seen
        if skipped > 0:
            self.skipped_seen += skipped
            event, line, self.reruns_seen = stability.skipped_event(self.cfg, step, skipped, self.skipped_seen,
                                                                    values, self.reruns_seen)  # fmt: skip
            self.writer.write(step, event, console=line)
        return stability.trouble(self.cfg, int(values["bad_in_window"]), int(values["diverged_run"]))

    def roll_back(self, reason: str) -> None:
        from_step = self.step

        def restore(step):
            return resume.restore_state(self.ckpt, step, self.setup, None, self.cfg, self.reset_label)[0]

        with self.goodput.phase("rollback"):
            self.state, skipped_batches = roll_back(self.cfg, self.ckpt, restore, self.state, self.data_read)
            self.step, self.trained, self.data_read, self.skipped_seen = self._clocks()
            if self.local is not None:
                self.local.rolled_back_to(self.step)
        self.goodput.rolled_back(self.step)
        self.dispatched = []
        lr_scale = float(fetch(self.state.stability["lr_scale"]))
        event, line = rollback_event(reason, from_step, self.step, lr_scale, skipped_batches)
        self.writer.write(self.step, event, console=line)
        if not self.primary:  # every host's log shows where it went back to
            print(f"process {self.process}: {line.strip()}", flush=True)
        self.hang.progress()
        self._mark()

    def evaluate_and_save(self, force_save: bool) -> None:
        cfg, step, done = self.cfg, self.step, self.trained >= self.target
        evaluate = self.evaluator is not None and (step % cfg.train.eval_every == 0 or done)
        every = cfg.train.harness_every or cfg.train.eval_every
        harness = self.harness is not None and (done or bool(every) and step % every == 0)
        save = step % cfg.checkpoint.every_steps == 0 or done or force_save
        local = not save and self.local is not None and step % cfg.checkpoint.local_every_steps == 0
        if not (evaluate or harness or save or local):
            return
        # Let queued training steps finish first, so that the pause excluded
        # from step_time is evaluation and saving alone.
        jax.block_until_ready(self.state)
        paused = time.perf_counter()
        if evaluate:
            self.goodput.enter("eval")
            result = self.evaluator(self.setup.weights(self.state.params, self.inputs), self.hang.progress)
            self.last.update(result, eval_covers=self.evaluator.covers(result) if "eval_tokens" in result else "")
            covers = self.evaluator.covers(result) if "unigram_loss" in result else ""
            self.writer.write(step, result, console=eval_line(step, result, covers))
            if self.samples is not None:
                with self.hang.suspended() if not self.sampled else contextlib.nullcontext():  # the first compiles
                    self.writer.samples(step, self.samples(self.setup.weights(self.state.params, self.inputs)))
                self.sampled = True
        if harness:
            self.goodput.enter("eval")
            result, line = self.harness(self.setup.weights(self.state.params, self.inputs), step)
            self.last.update(result)
            self.writer.write(step, result, console=line)
            self.hang.progress()
        if local:
            self.goodput.enter("checkpoint")
            self.local.save(step, self.state, self.data, self.reset_label)
            self.goodput.saved(step, self._kept_steps())
            self.hang.progress()
        if save:
            self.goodput.enter("checkpoint")
            self._save(step)
            if self.files is not None:  # into a bucket: the metrics up to the checkpoint go with it
                self.files.sync()
            self.hang.progress()
        self.goodput.enter("step")
        self.mark_time += time.perf_counter() - paused

    def save_now(self) -> None:
        if self.step not in self.ckpt.steps():
            with self.goodput.phase("checkpoint"):
                self._save(self.step)

    def _save(self, step: int) -> None:
        self.ckpt.save(step, self.state, self.data, reset_label=self.reset_label)
        self.goodput.saved(step, self._kept_steps())

    def _kept_steps(self) -> list[int]:
        """The steps a later launch could resume from, in either tier."""
        return sorted({*self.ckpt.steps(), *(self.local.steps() if self.local is not None else ())})

    def close(self) -> None:
        """Closes what is open, in an order that lets the last checkpoint commit before the files follow it."""
        self.goodput.enter("startup")  # closing down is counted with starting up
        if self.data is not None:  # the reading-ahead thread first: it may be reading from the rows or workers
            self.data.close()
        if self.row_batches is not None:  # then the rows' iterators (or the workers): Grain closes parent by parent
            self.row_batches.close()
        if self.profiler is not None:
            self.profiler.stop()
        for tier in (self.local, self.ckpt):
            if tier is not None:
                with self.goodput.phase("checkpoint"):
                    tier.wait()
                tier.close()
        if self.writer is not None:
            self.writer.close()
        self.goodput.close()  # before the files are closed: a bucket gets the final account
        if self.files is not None:
            self.files.close()
        if self.hang is not None:  # last: the final checkpoint's commit and the files' upload are watched too
            self.hang.close()
