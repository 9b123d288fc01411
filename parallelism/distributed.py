"""Starting JAX's distributed runtime when a run spans several processes.

Where the processes come from, in order:
1. explicit values (the scripts' --coordinator/--num_processes/--process_id flags);
2. the environment our launcher sets: TRAINER_COORDINATOR (host:port),
   TRAINER_NUM_PROCESSES, TRAINER_PROCESS_ID (scripts/launch_local.py does this);
3. a cluster JAX detects by itself: a multi-host TPU slice or a SLURM job of
   several tasks, where jax.distributed.initialize() needs no arguments.
A single process does nothing. On CPUs, collectives between processes go
through gloo.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from parallelism.errors import ConfigError

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "TRAINER_COORDINATOR",
    "TRAINER_NUM_PROCESSES",
    "TRAINER_PROCESS_ID",
)


def _cluster_detected() -> bool:
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return slurm_tasks > 1 or "," in tpu_hosts


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """Start jax.distributed if this run has several processes; must precede any JAX computation."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes or int(os.environ.get(ENV_NUM_PROCESSES, "0")) or None
    if process_id is None and ENV_PROCESS_ID in os.environ:
        process_id = int(os.environ[ENV_PROCESS_ID])
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise ConfigError(
            "a multi-process run needs all of the coordinator address, the number of processes and this "
            f"process's id (flags or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if all(given):
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"process id {process_id} is outside 0..{num_processes - 1}.")
        if num_processes > 1:
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    elif _cluster_detected():
        jax.distributed.initialize()


def fetch(tree):
    """Host copies of replicated arrays (metrics, losses): each process reads its own replica,
    since a multi-process array spans devices that this process cannot address."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)
