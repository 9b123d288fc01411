"""Orbax checkpoints: the train state in parts, and the data iterator, together.

A checkpoint is a step directory with up to four items:
`params` and `opt_state` (each process writes its own shards), `meta` (step,
RNG, clock, loss scale and stability state, the layout's `format` and the
label of the run's last optimiser reset) and `data` (the position of
every global-batch row's data stream, as JSON, one file per process, merged on
restore so any process layout can resume). Parameters are an item of their own
so that evaluation and export read nothing else.

Saves are asynchronous: the arrays are copied off the devices, then written
while training goes on. Orbax writes into a temporary directory and renames it
when complete, so a crash mid-save leaves no checkpoint that looks whole; its
leftovers are removed at the next start (by Orbax, on process 0 alone). A
checkpoint that any process cannot read (a truncated or missing file) is
moved to `damaged_checkpoints/` beside the checkpoint directory, never
deleted, by process 0 while the others wait, and all of them try the next
older one.
Whether a readable checkpoint fits the config is decided before that, from its
metadata (trainer/training/resume.py), so a changed config never sets one aside.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from parallelism.distributed import max_over_processes
from trainer.config import last_words
from trainer.config.errors import ConfigError, StorageError
from trainer.storage import faults
from trainer.storage.workdir import forget_listings, move, path

PARAMS, OPT_STATE, META, DATA = "params", "opt_state", "meta", "data"
# 3: the data position is keyed by global-batch row, and meta holds the clock (in sequences), the
# loss scale and the stability state apart. 4: the clock in two words and its batch
# (trainer/training/clock.py), and `reset_optimizer` the label of the last reset, not a flag.
# Older layouts are read by training/resume.py.
FORMAT = 4
# Orbax and TensorStore report a missing, truncated or corrupt file with many exception types, a bare
# Exception among them; these, though, are faults in the code, and setting checkpoints aside for one
# would hide it behind "damaged" files.
CODE_FAULTS = (TypeError, AttributeError, NameError, ImportError, AssertionError, NotImplementedError)

# The training state (trainer/training/state.py's TrainState): storage saves any flax dataclass of arrays by
# its fields, so it sits below the training it stores.
State = Any


class Failed:
    """What a handler's restore returns instead of raising (see Guarded)."""

    def __init__(self, error: Exception):
        self.error = error


class Guarded(ocp.StandardCheckpointHandler):
    """Orbax's handler, whose restore returns the failure instead of raising it. Orbax waits for every
    process at a barrier once the handlers have restored; a process that raised before it would leave
    the others waiting there, and its next collective would meet their barrier instead of its own."""

    def restore(self, directory, args=None):
        try:
            return super().restore(directory, args=args)
        except Exception as e:
            return Failed(e)


@ocp.args.register_with_handler(Guarded, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.StandardSave):
    pass


@ocp.args.register_with_handler(Guarded, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.StandardRestore):
    pass


class Unreadable(Exception):
    """A read of a checkpoint that failed on some process. `kind` (faults.DAMAGED, TRANSIENT or STOP) is the
    worst of every process's, so all raise it together; `error` is this process's own (None: it read its part)."""

    def __init__(self, kind: int, error: Exception | None, what: str):
        self.kind, self.error, self.what = kind, error, what
        reason = faults.summary(error) if error is not None else "another process could not read its part"
        super().__init__(f"{what}: {reason}")


class DataStateHandler:
    """The data iterator's position: each process writes its rows' states; restoring reads
    every process's file and takes the rows it now holds, whatever the process count was."""

    def save(self, directory, args=None):
        path = directory / f"process_{jax.process_index()}.json"
        path.write_text(json.dumps(args.item.get_state()))

    def restore(self, directory, args=None):
        try:
            rows = {}
            for file in directory.glob("process_*.json"):
                rows.update(json.loads(file.read_text())["rows"])
            args.item.set_state({"rows": rows})
            return args.item
        except Exception as e:  # as Guarded does
            return Failed(e)

    def metadata(self, directory):
        return None

    def structure(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass

    @classmethod
    def typestr(cls):
        return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    item: Any


class Checkpointer:
    def __init__(
        self, directory: str, *, keep: int = 1, keep_every: int = 0, async_save: bool = True, read_only: bool = False
    ):
        """`read_only` for evaluation and export: nothing is created, cleaned up or deleted, so it is
        safe beside a training run that is writing into the same directory."""
        self.directory = str(path(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            keep_period=keep_every or None,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        handlers = {
            PARAMS: Guarded(),
            OPT_STATE: Guarded(),
            META: Guarded(),
            DATA: DataStateHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: State, data_iterator, *, reset_label: int = 0) -> None:
        """`reset_label`: the run's last honoured checkpoint.reset_optimizer (trainer/training/resume.py)."""
        meta = {"step": state.step, "rng": state.rng, "clock": state.clock, "loss_scale": state.loss_scale,
                "stability": state.stability, "format": np.int32(FORMAT),
                "reset_optimizer": np.int32(reset_label)}  # fmt: skip
        items = {
            PARAMS: Save(state.params),
            OPT_STATE: Save(state.opt_state),
            META: Save(meta),
        }
        if data_iterator is not None:
            items[DATA] = DataSave(data_iterator)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def _read(self, step: int, work: Callable[[], Any]):
        """`work()`, a read of the checkpoint at `step`, and then every process's verdict on it: all return,
        or all raise Unreadable with the worst verdict (a collective: every process reads, then asks)."""
        result, error = None, None
        try:
            # The libraries' words while a read fails are dropped: the error is said in ours (last_words.py).
            with last_words.held_while_reading(lambda e: faults.verdict(e) == faults.STOP):
                result = work()
                failed = [r for r in (result.values() if isinstance(result, Mapping) else ()) if isinstance(r, Failed)]
                if failed:
                    raise failed[0].error
        except (ConfigError, *CODE_FAULTS):
            raise
        except Exception as e:
            error = e
        kind = faults.verdict(error)
        if kind == faults.DAMAGED:
            kind, error = self._confirm_damage(step, error)
        worst = max_over_processes(kind)
        if worst != faults.OK:
            raise Unreadable(worst, error, f"reading the checkpoint at step {step} in {self.directory}")
        return result

    def _confirm_damage(self, step: int, error: BaseException) -> tuple[int, BaseException]:
        """A file that seems missing or short is the checkpoint's fault only if the storage answers about the
        checkpoint itself: list its directory; if that fails, the fault is the storage's."""
        try:
            next(iter((path(self.directory) / str(step)).iterdir()), None)
        except Exception as e:
            kind = faults.verdict(e)
            return (kind if kind != faults.DAMAGED else faults.STOP), e
        return faults.DAMAGED, error

    def metadata(self, step: int) -> dict:
        """Each item's tree of array metadata (shapes, dtypes); raises Unreadable if it cannot be read."""

        def read():
            metadata = self._manager.item_metadata(step)
            missing = {PARAMS, OPT_STATE, META} - set(metadata.keys())
            if missing:
                raise faults.Damaged(f"items {sorted(missing)} are missing")
            return {name: metadata[name] for name in (PARAMS, OPT_STATE, META)}

        return self._read(step, read)

    def committed_at(self, step: int) -> int | None:
        """When the checkpoint at `step` was committed (ns since the epoch; None where Orbax kept no time):
        a rolled-back run that saves the same step again saves another checkpoint."""
        return self._read(step, lambda: self._manager.metadata(step).commit_timestamp_nsecs)

    def data_rows(self, step: int) -> set[int] | None:
        """The batch rows whose data position the checkpoint holds (None: it holds no data position)."""
        directory = path(self.directory) / str(step) / DATA
        if not directory.is_dir():
            return None
        rows = set()
        for file in directory.glob("process_*.json"):
            rows.update(int(r) for r in json.loads(file.read_text())["rows"])
        return rows

    def check_params(self, step: int, abstract_params: dict) -> None:
        """Refuse a checkpoint whose parameters differ from the model's, naming the first that does."""
        metadata = self._manager.item_metadata(step)
        if PARAMS not in metadata.keys():
            raise ConfigError(
                f"the checkpoint at step {step} in {self.directory} holds {sorted(metadata.keys())}, not "
                f"'{PARAMS}': it was not written by this trainer's checkpoint layout."
            )
        saved_shapes = {name: shape for name, (shape, _) in arrays(metadata[PARAMS]).items()}
        wanted = {name: shape for name, (shape, _) in arrays(abstract_params).items()}
        for name in sorted(saved_shapes.keys() | wanted.keys()):
            have, want = saved_shapes.get(name), wanted.get(name)
            if have != want:
                raise ConfigError(
                    f"the checkpoint at step {step} in {self.directory} does not fit this model: parameter "
                    f"{name} has shape {have} in the checkpoint and {want} in the model "
                    "(None = absent); use the config it was trained with."
                )

    def restore_params(self, step: int, target: dict) -> dict:
        """Parameters only, placed as `target`'s shardings say; the optimiser state is never read."""
        self.check_params(step, target)
        items = ocp.args.Composite(**{PARAMS: Restore(target)})
        return self._read(step, lambda: self._manager.restore(step, args=items))[PARAMS]

    def restore_parts(self, step: int, target, keep: Callable) -> Any:
        """Some of the optimiser state's arrays, into `target`'s shapes and shardings (its abstract state): those
        whose key path `keep` accepts; the others are never read (Orbax's placeholders), so a reader of the
        weights' moving average holds no moments."""
        wanted = jax.tree_util.tree_map_with_path(lambda p, x: x if keep(p) else ocp.PLACEHOLDER, target)
        restore_args = jax.tree.map(
            lambda x: ocp.RestoreArgs() if x is ocp.PLACEHOLDER
            else ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), wanted,
        )  # fmt: skip
        folder = path(self.directory) / str(step) / OPT_STATE
        args = ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args)

        def read():
            with ocp.PyTreeCheckpointer() as reader:
                return reader.restore(folder, args=args)

        return self._read(step, read)

    def restore_meta(self, step: int, sharding) -> dict:
        """The meta item as saved (its own shapes, whatever config wrote it), as host arrays."""

        def read():
            target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
                                  self._manager.item_metadata(step)[META])  # fmt: skip
            return self._manager.restore(step, args=ocp.args.Composite(**{META: Restore(target)}))

        meta = self._read(step, read)[META]
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), meta)

    def restore(self, step: int, params: dict, opt_state, data_iterator) -> tuple[dict, object]:
        """Parameters and (unless `opt_state` is None) the optimiser state into the targets' shapes and
        shardings; the data iterator, if given, is restored in place."""

        def read():
            items = {PARAMS: Restore(params)}
            if opt_state is not None:
                items[OPT_STATE] = Restore(opt_state)
            if data_iterator is not None and (path(self.directory) / str(step) / DATA).is_dir():
                items[DATA] = DataRestore(data_iterator)
            return self._manager.restore(step, args=ocp.args.Composite(**items))

        r = self._read(step, read)
        return r[PARAMS], r[OPT_STATE] if opt_state is not None else None

    def restore_newest_intact(
        self, restore: Callable[[int], object], say: Callable[[str], None], retry_seconds: float
    ) -> tuple[int, object] | None:
        """`restore(step)` on the newest checkpoint that reads back whole, setting damaged ones aside.

        Only a checkpoint whose own files are bad is set aside (trainer/storage/faults.py); trouble
        around it (memory, credentials, the storage failing) moves nothing: transient trouble is retried
        with backoff for `retry_seconds`, then, like any other trouble, raises StorageError. Each read
        ends with every process's verdict (`_read`), so all go on, retry, or stop together.
        Returns None when there are no checkpoints; raises ConfigError when there are some but none
        can be read (never a silent fresh start).
        """
        steps = self.steps()
        for step in reversed(steps):
            deadline, wait = time.monotonic() + retry_seconds, 1.0
            while True:
                try:
                    return step, restore(step)
                except Unreadable as e:
                    failure = e
                if failure.kind == faults.TRANSIENT and not max_over_processes(int(time.monotonic() >= deadline)):
                    say(f"{failure}; retrying in {wait:.0f}s")
                    time.sleep(wait)
                    wait = min(2 * wait, 60.0)
                    continue
                if failure.kind != faults.DAMAGED:
                    raise StorageError(faults.stopped(failure.what, failure.error, failure.kind, retry_seconds))
                break
            moved = self.set_aside(step, "damaged_checkpoints")
            say(f"checkpoint at step {step} cannot be read ({failure}); moved to {moved}, trying an older one")
        if steps:
            raise ConfigError(
                f"none of the checkpoints {steps} in {self.directory} can be read (moved to damaged_checkpoints/); "
                "restore one from a backup, or move the directory away to start afresh."
            )
        return None

    def set_aside(self, step: int, folder: str) -> str:
        """Move a checkpoint out of the way (into <workdir>/<folder>/<step>, or <step>.1, ... if that is
        taken), never deleting it; returns where it went.

        Every process calls it, once all have finished reading it; process 0 alone moves (the storage is
        shared) and the others wait. In a bucket the move copies and checks every object before it deletes
        any (workdir.move), so a move that fails or is killed leaves the checkpoint whole in one place."""
        source, target, error = path(self.directory) / str(step), path(self.directory).parent / folder, None
        if jax.process_index() == 0:
            try:
                target = target / str(step)
                suffix = 0
                while target.exists():
                    suffix += 1
                    target = target.parent / f"{step}.{suffix}"
                move(source, target)
            except Exception as e:
                error = e
        if max_over_processes(int(error is not None)):  # every process waits for the move here
            reason = faults.summary(error) if error is not None else "on process 0"
            last_words.when_stopping()
            raise StorageError(
                f"setting the checkpoint at step {step} aside into {target} failed ({reason}); nothing is lost (it "
                f"is whole in {source} or there); rerun to try again once the storage answers."
            )
        forget_listings(self.directory)
        self._manager.reload()
        return str(target)

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def arrays(tree) -> dict[str, tuple[tuple[int, ...], object]]:
    """{dotted path: (shape, dtype)} of a state tree or of a checkpoint's metadata for it, comparable
    across the two (Orbax's metadata turns namedtuples into dicts and empty states into None)."""
    return {
        ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path): (
            tuple(x.shape),
            np.dtype(x.dtype),
        )
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }
