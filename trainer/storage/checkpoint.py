"""Orbax checkpoints: the train state in parts, and the data iterator, together.

A checkpoint is a step directory with up to four items:
`params` and `opt_state` (each process writes its own shards), `meta` (step,
RNG, clock, loss scale and stability state, the layout's `format` and whether
the writing run had reset its optimiser) and `data` (the position of
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
metadata (trainer/storage/resume.py), so a changed config never sets one aside.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from parallelism.distributed import any_process, barrier
from trainer.errors import ConfigError
from trainer.storage.workdir import forget_listings, move, path
from trainer.training.state import TrainState

PARAMS, OPT_STATE, META, DATA = "params", "opt_state", "meta", "data"
# 3: the data position is keyed by global-batch row, and meta holds the clock (in sequences), the
# loss scale and the stability state apart. Older layouts are read by storage/resume.py.
FORMAT = 3
# Orbax and TensorStore report a missing, truncated or corrupt file with many exception types, a bare
# Exception among them; these, though, are faults in the code, and setting checkpoints aside for one
# would hide it behind "damaged" files.
CODE_FAULTS = (TypeError, AttributeError, NameError, ImportError, AssertionError, NotImplementedError)


class DataStateHandler:
    """The data iterator's position: each process writes its rows' states; restoring reads
    every process's file and takes the rows it now holds, whatever the process count was."""

    def save(self, directory, args=None):
        path = directory / f"process_{jax.process_index()}.json"
        path.write_text(json.dumps(args.item.get_state()))

    def restore(self, directory, args=None):
        rows = {}
        for file in directory.glob("process_*.json"):
            rows.update(json.loads(file.read_text())["rows"])
        args.item.set_state({"rows": rows})
        return args.item

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
            PARAMS: ocp.StandardCheckpointHandler(),
            OPT_STATE: ocp.StandardCheckpointHandler(),
            META: ocp.StandardCheckpointHandler(),
            DATA: DataStateHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, data_iterator, *, reset_optimizer: bool = False) -> None:
        meta = {"step": state.step, "rng": state.rng, "clock": state.clock, "loss_scale": state.loss_scale,
                "stability": state.stability, "format": np.int32(FORMAT),
                "reset_optimizer": np.int32(reset_optimizer)}  # fmt: skip
        items = {
            PARAMS: ocp.args.StandardSave(state.params),
            OPT_STATE: ocp.args.StandardSave(state.opt_state),
            META: ocp.args.StandardSave(meta),
        }
        if data_iterator is not None:
            items[DATA] = DataSave(data_iterator)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def metadata(self, step: int) -> dict:
        """Each item's tree of array metadata (shapes, dtypes); raises if the checkpoint cannot be read."""
        metadata = self._manager.item_metadata(step)
        missing = {PARAMS, OPT_STATE, META} - set(metadata.keys())
        if missing:
            raise OSError(f"items {sorted(missing)} are missing")
        return {name: metadata[name] for name in (PARAMS, OPT_STATE, META)}

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
        restored = self._manager.restore(step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardRestore(target)}))
        return restored[PARAMS]

    def restore_meta(self, step: int, sharding) -> dict:
        """The meta item as saved (its own shapes, whatever config wrote it), as host arrays."""
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), self._manager.item_metadata(step)[META]
        )
        meta = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.StandardRestore(target)}))[META]
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), meta)

    def restore(self, step: int, params: dict, opt_state, data_iterator) -> tuple[dict, object]:
        """Parameters and (unless `opt_state` is None) the optimiser state into the targets' shapes and
        shardings; the data iterator, if given, is restored in place."""
        items = {PARAMS: ocp.args.StandardRestore(params)}
        if opt_state is not None:
            items[OPT_STATE] = ocp.args.StandardRestore(opt_state)
        if data_iterator is not None and (path(self.directory) / str(step) / DATA).is_dir():
            items[DATA] = DataRestore(data_iterator)
        r = self._manager.restore(step, args=ocp.args.Composite(**items))
        return r[PARAMS], r[OPT_STATE] if opt_state is not None else None

    def restore_newest_intact(
        self, restore: Callable[[int], object], say: Callable[[str], None]
    ) -> tuple[int, object] | None:
        """`restore(step)` on the newest checkpoint that reads back whole, setting damaged ones aside.

        Returns None when there are no checkpoints; raises ConfigError when there
        are some but none can be read (never a silent fresh start).
        """
        steps = self.steps()
        for step in reversed(steps):
            try:
                result, reason = restore(step), None
            except (ConfigError, *CODE_FAULTS):
                raise
            except Exception as e:  # the files cannot be read
                result, reason = None, " ".join(str(e).split())[:200]
            # A damaged shard may fail one process only: all of them go on to an older step, or none.
            if not any_process(reason is not None):
                return step, result
            reason = reason or "another process could not read its part"
            moved = self.set_aside(step, "damaged_checkpoints")
            say(f"checkpoint at step {step} cannot be read ({reason}); moved to {moved}, trying an older one")
        if steps:
            raise ConfigError(
                f"none of the checkpoints {steps} in {self.directory} can be read (moved to damaged_checkpoints/); "
                "restore one from a backup, or move the directory away to start afresh."
            )
        return None

    def set_aside(self, step: int, folder: str) -> str:
        """Move a checkpoint out of the way (into <workdir>/<folder>/), never deleting it.

        Every process calls it; process 0 alone moves (the storage is shared) and the others wait.
        In a bucket a move is a copy of every object and a delete: slower, and as safe, since the
        checkpoint is out of the listing only once its copy is whole."""
        target_dir = path(self.directory).parent / folder
        target = target_dir / str(step)
        suffix = 0
        while target.exists():
            suffix += 1
            target = target_dir / f"{step}.{suffix}"
        barrier(f"set aside {step}: named")  # no process looks once process 0 has moved it
        if jax.process_index() == 0:
            move(path(self.directory) / str(step), target)
        barrier(f"set aside {step}: moved")
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
