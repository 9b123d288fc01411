"""Starting JAX's distributed runtime when a run spans several processes.

Where the processes come from, in order:
1. explicit values (the scripts' --coordinator/--num_processes/--process_id flags);
2. the environment our launcher sets: TRAINER_COORDINATOR (host:port),
   TRAINER_NUM_PROCESSES, TRAINER_PROCESS_ID (scripts/launch_local.py does this);
3. a cluster JAX detects by itself: a SLURM job of several tasks or a GKE TPU
   slice (seen from their environment variables), or any cluster JAX knows
   when the scripts are given --multihost (a Cloud TPU VM slice).
A single process does nothing. On CPUs, collectives between processes go
through gloo.

A process that dies must not leave the others waiting in a collective or a
checkpoint barrier. JAX's runtime notices by its heartbeat and then aborts the
survivors from C++ with a trace (a Python callback for that cannot be given in
jax 0.10.2: the runtime fails to pass it the status). So each process runs a
Watchdog that notices first, names the lost process and exits. If process 0
(the coordinator) dies, the runtime ends the others at once with its own
"another task died" message: the coordinator held the service they report to.

A process that stops on an error of its own says why under a key of the runtime's
key-value store (`stop_all`): the others' watchdogs end them at once with that
sentence, wherever they wait (a collective, a checkpoint barrier), instead of after
a timeout or the dead-process wait. One that stops because the run made no progress
(trainer/run/hang.py) also asks for the others' stacks: each then writes its
own (`on_stacks_asked`) before it ends.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import jax
import numpy as np

from parallelism.config_error import ConfigError

LOST_SECONDS = 20  # a process silent this long is dead (a compile or a pause never silences the beating thread)
STOPPED = "trainer/stopped/"  # + process index: why that process stopped
STACKS = "trainer/stacks"  # set before a stop whose reason every process's stacks help to find
_stack_writer = None  # called with the reason before this process ends on such a stop (on_stacks_asked)
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "TRAINER_COORDINATOR",
    "TRAINER_NUM_PROCESSES",
    "TRAINER_PROCESS_ID",
)


def _cluster_detected() -> bool:
    slurm_tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return slurm_tasks > 1 or "," in tpu_hosts


def initialize(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, detect=False
):
    """Start jax.distributed if this run has several processes; must precede any JAX computation.

    `detect`: let JAX find the cluster itself (a Cloud TPU VM slice, whose workers it reads from the
    VM's metadata server, which is not worth asking on every machine)."""
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
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                       **timeouts(num_processes))  # fmt: skip
    elif detect or _cluster_detected():
        try:
            # The size is known only once joined: assume a large pod, so the runtime's heartbeat stays the later.
            jax.distributed.initialize(**timeouts(int(os.environ.get("SLURM_NTASKS", "1024"))))
        except ValueError as e:  # nothing detected: JAX names the first value it lacks
            raise ConfigError(
                f"--multihost found no cluster to join ({e}); it finds Cloud TPU VM slices, SLURM and Open MPI "
                "jobs; elsewhere pass --coordinator, --num_processes and --process_id."
            ) from e
    if runtime_started():
        Watchdog().start()


def _client():
    from jax._src import distributed  # the runtime's client: jax exposes no public handle to it

    return distributed.global_state.client


def runtime_started() -> bool:
    """Whether this process joined a multi-process run through JAX's distributed runtime (without it,
    as on a TPU slice launched without --multihost, there is neither watchdog nor a common stop)."""
    return _client() is not None


def beat_seconds(processes: int) -> float:
    """How often each process says it is alive: every second up to 64 processes, then slower, so that the
    coordinator answers about 128 small requests a second however large the pod."""
    return max(1.0, processes / 64)


def lost_seconds(processes: int) -> float:
    return max(LOST_SECONDS, 5 * beat_seconds(processes))


def timeouts(processes: int) -> dict:
    """The runtime's own heartbeat, 3x the watchdog's verdict: the runtime must not rule a process dead
    first (it would abort the survivors with a trace); and how long a finishing process waits for the others."""
    return dict(heartbeat_timeout_seconds=round(3 * lost_seconds(processes)), shutdown_timeout_seconds=60)


class Watchdog(threading.Thread):
    """Ends this process, naming the lost one, when another process of the run stops beating.

    Every process counts up a key of its own in the runtime's key-value store
    each beat. Process 0 reads them all in one request per beat: a count that
    has not moved for `lost_seconds` (by its clock: hosts' clocks never meet)
    is a dead process, and it posts the verdict under one key that the others
    read each beat. Everyone then says which process was lost and exits;
    process 0 last, since the runtime's coordinator lives in it.
    """

    def __init__(self):
        super().__init__(name="trainer-watchdog", daemon=True)
        self.client, self.me, self.count = _client(), jax.process_index(), jax.process_count()
        self.beat, self.limit = beat_seconds(self.count), lost_seconds(self.count)
        # Stopped before the interpreter shuts down (atexit runs this before JAX's own shutdown, registered
        # earlier): a daemon thread still inside the runtime's C++ calls then aborts the process.
        self._stopping = threading.Event()
        atexit.register(self.stop)

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=5 * self.beat)

    def run(self):
        last = {p: (None, time.monotonic()) for p in range(1, self.count)}  # process 0's view of the others
        while not self._stopping.is_set():
            try:
                self.client.key_value_increment(f"trainer/alive/{self.me}", 1)
                stopped = stopped_peers(self.client, self.me)
                lost = [] if stopped else self._judge(last) if self.me == 0 else self._verdict()
            except Exception:  # the runtime is shutting down (the run ended) or its coordinator is gone
                return
            if _stopped_myself.is_set():  # this process has said its own sentence and is ending: nothing to add
                return
            if stopped:
                p, why = stopped[0]
                print(f"error: process {p} of {self.count} stopped: {why}", file=sys.stderr, flush=True)
                if _stack_writer is not None and _stacks_asked(self.client):
                    _stack_writer(f"process {p} of {self.count} stopped: {why}")
                _exit_together(self.me, self.beat)
            if lost:
                print(
                    f"error: process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {self.count} "
                    f"stopped responding ({self.limit:g} s without a sign of life); relaunch every process with "
                    "the same command to resume from the newest complete checkpoint.",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
                _exit_together(self.me, self.beat)
            self._stopping.wait(self.beat)

    def _judge(self, last: dict) -> list[int]:
        now = time.monotonic()
        counts = {int(key.rsplit("/", 1)[1]): value for key, value in self.client.key_value_dir_get("trainer/alive/")}
        for p, (count, _) in list(last.items()):
            if counts.get(p) != count:
                last[p] = (counts.get(p), now)
        lost = [p for p, (_, since) in last.items() if now - since > self.limit]
        if lost:
            self.client.key_value_set("trainer/lost", ",".join(map(str, lost)))
        return lost

    def _verdict(self) -> list[int]:
        try:
            return [int(p) for p in self.client.key_value_try_get("trainer/lost").split(",")]
        except Exception:  # no verdict (the key is absent)
            return []


def _exit_together(me: int, beat: float) -> None:
    """Ends this process now. Not sys.exit: the runtime's shutdown at exit would wait for the lost process."""
    sys.stdout.flush()
    if me == 0:
        time.sleep(3 * beat)  # the others read the verdict before the coordinator, which holds it, goes
    os._exit(1)


_stopped_myself = threading.Event()  # set by stop_all: the watchdog then says nothing of the others' stops


def stopped_peers(client, me: int) -> list[tuple[int, str]]:
    """(process, why) of the other processes that stopped on an error of their own."""
    entries = client.key_value_dir_get(STOPPED)
    return sorted((int(key.rsplit("/", 1)[1]), why) for key, why in entries if int(key.rsplit("/", 1)[1]) != me)


def stop_all(why: str, stacks: bool = False) -> None:
    """In a multi-process run, end this process after `why` (already printed), telling the others so that
    they end at once with it (their watchdogs read it), each writing its stacks first if `stacks`; a single
    process returns and exits as usual."""
    client = _client()
    if client is None or jax.process_count() == 1:
        return
    _stopped_myself.set()
    try:
        if stacks:
            client.key_value_set(STACKS, "1")
        client.key_value_set(f"{STOPPED}{jax.process_index()}", why)
    except Exception:  # the coordinator is gone: the others end by the runtime's own notice
        pass
    _exit_together(jax.process_index(), beat_seconds(jax.process_count()))


def on_stacks_asked(writer) -> None:
    """`writer(reason)` writes this process's stacks when another process stops asking for them (None: not
    any more); the watchdog calls it before ending this process."""
    global _stack_writer
    _stack_writer = writer


def _stacks_asked(client) -> bool:
    try:
        return client.key_value_try_get(STACKS) == "1"
    except Exception:  # the key is absent
        return False


def wait_if_a_process_died(error: BaseException) -> None:
    """A failed collective in a multi-process run may be a dead peer (gloo fails as soon as its connection
    closes): if some process has stopped beating, give the watchdog the time to rule on it, which ends this
    process if so. If all beat on, the error is this process's own, reported at once."""
    if jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError) or _client() is None:
        return
    count, client = jax.process_count(), _client()
    try:
        before = dict(client.key_value_dir_get("trainer/alive/"))
        time.sleep(3 * beat_seconds(count))
        after = dict(client.key_value_dir_get("trainer/alive/"))
    except Exception:
        return
    if stopped_peers(client, jax.process_index()) or any(after.get(k) == v for k, v in before.items()):
        time.sleep(lost_seconds(count) + 5 * beat_seconds(count))


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (a collective: every process must ask)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.array(value, np.int32))))


def differing_from_first(value: bytes) -> list[tuple[int, bytes]]:
    """(process, its value) for each process whose `value` (up to 32 bytes) is not process 0's (a
    collective: every process must ask)."""
    if jax.process_count() == 1:
        return []
    from jax.experimental import multihost_utils

    padded = np.frombuffer(value.ljust(32, b"\0")[:32], np.uint8).astype(np.int32)
    values = [bytes(row.astype(np.uint8)) for row in np.asarray(multihost_utils.process_allgather(padded))]
    return [(p, v) for p, v in enumerate(values) if v != values[0]]


def first_process_says(value: bytes) -> bytes:
    """Process 0's `value` (16 bytes) on every process (a collective: every process must ask)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    mine = np.frombuffer(value.ljust(16, b"\0")[:16], np.uint8).astype(np.int32)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine)).astype(np.uint8))


def barrier(name: str) -> None:
    """Every process waits here until all have arrived."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def whole(tree):
    """Host copies of sharded arrays, whole on every process (a rollout's completions: each process holds
    some rows, and every process rewards them all)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def fetch(tree):
    """Host copies of replicated arrays (metrics, losses): each process reads its own replica,
    since a multi-process array spans devices that this process cannot address."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)
