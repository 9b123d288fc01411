"""Rolling a troubled run back to its newest healthy checkpoint.

The checkpoints written since (saved while the run was already in trouble) are
moved to `rolled_back_checkpoints/`, never deleted. The data stream is not
rewound: the batches read since the checkpoint are skipped, in case they were
the trouble. The learning rate is multiplied by `stability.rollback_lr_factor`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from trainer.config.errors import TrainingError
from trainer.storage.checkpoint import Checkpointer
from trainer.training import clock, stability
from trainer.training.state import TrainState


def roll_back(
    cfg, ckpt: Checkpointer, restore: Callable[[int], TrainState], current: TrainState, data_read: int
) -> tuple[TrainState, float]:
    """(the state to go on from, data batches skipped); raises TrainingError past
    `stability.max_rollbacks` or with no healthy checkpoint to go back to.

    `restore(step)` reads a checkpoint onto the mesh. The rollback count and
    learning-rate scale carry over from the current state: the checkpoint predates them.
    """
    current_step = int(jax.device_get(current.step))
    previous = jax.device_get({k: current.stability[k] for k in ("rollbacks", "lr_scale")})
    rollbacks = int(previous["rollbacks"]) + 1
    if rollbacks > cfg.stability.max_rollbacks:
        raise TrainingError(
            f"the run has needed {rollbacks} rollbacks (stability.max_rollbacks={cfg.stability.max_rollbacks}); "
            "it does not recover by itself: lower optim.lr or look at the data near this point."
        )
    ckpt.wait()
    replicated = current.step.sharding
    candidates = [s for s in ckpt.steps() if s < current_step]
    for step in reversed(candidates):
        if stability.healthy(ckpt.restore_meta(step, replicated)["stability"]):
            break
    else:
        raise TrainingError(
            f"the run is in trouble at step {current_step} and no checkpoint before it was saved in good health; "
            "lower optim.lr or save checkpoints more often."
        )
    for later in [s for s in ckpt.steps() if s > step]:
        ckpt.set_aside(later, "rolled_back_checkpoints")
    state = restore(step)  # the data stream goes on from where it is
    stats = state.stability
    batch = cfg.train.global_batch_size
    skipped = data_read - clock.value(jax.device_get(state.clock["data_read"]), batch)
    changes = {
        "lr_scale": jnp.float32(previous["lr_scale"] * cfg.stability.rollback_lr_factor),
        "rollbacks": jnp.int32(rollbacks),
        "recent_bad": jnp.zeros_like(stats["recent_bad"]),
        "diverged_run": jnp.int32(0),
    }
    changes = {k: jax.device_put(v, replicated) for k, v in changes.items()}
    counts = {**state.clock, "data_read": jax.device_put(clock.of(data_read, batch), replicated)}
    return state.replace(stability={**stats, **changes}, clock=counts), skipped / batch


def rollback_event(reason: str, from_step: int, to_step: int, lr_scale: float, skipped: float) -> tuple[dict, str]:
    """(the metrics record of a rollback, its console line)."""
    event = {"event": "rollback", "reason": reason, "from_step": from_step, "to_step": to_step,
             "lr_scale": lr_scale, "data_batches_skipped": skipped}  # fmt: skip
    line = (f"step {from_step:>6}  ROLLBACK to step {to_step}: {reason}; learning rate now x{lr_scale:g}, "
            f"the {skipped:g} data batches read since the checkpoint skipped")  # fmt: skip
    return event, line
