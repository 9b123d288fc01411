"""Orbax checkpoints of the train state and the data iterator, together.

One checkpoint = step directory with two items: `state` (params, optimiser
state, step, RNG; each process writes its own shards) and `data` (every
process's Grain iterator position, as JSON). Saves are asynchronous by
default: the arrays are copied off the devices, then written while training
goes on. Orbax writes into a temporary directory and renames it when complete,
so a crash mid-save never leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import grain
import orbax.checkpoint as ocp

from trainer.state import TrainState


class Checkpointer:
    def __init__(self, directory: str, *, keep: int, async_save: bool):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, data_iterator: grain.DatasetIterator) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)
            ),
        )

    def restore(self, step: int, target: TrainState, data_iterator: grain.DatasetIterator) -> TrainState:
        """Restore into `target`'s shapes and shardings; the iterator is restored in place."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=grain.checkpoint.CheckpointRestore(data_iterator)
            ),
        )
        return restored["state"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
