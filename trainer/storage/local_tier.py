"""The fast checkpoint tier: each process's own shards on its own disk, beside the persistent tier.

`checkpoint.local_dir` (a host's disk or RAM disk; `$VAR` and `~` expanded, so
processes sharing one machine can each have their own, e.g.
`/tmp/local/$TRAINER_PROCESS_ID`; each run a folder of its own in it, named
after its workdir and the run's identity, trainer/storage/workdir.py run_id, so
that a workdir deleted and made again is a new run that never takes the old
one's steps) gets a checkpoint every `checkpoint.local_every_steps`,
keeping the newest `checkpoint.local_keep`; the workdir keeps its own interval
and retention. Each process writes what its devices hold (every shard, replicas
too), one .npy file per shard with its CRC, into `<step>.partial/`, renamed to
`<step>` when whole; no process waits on another's disk. Each process also
writes the data position of every batch row (gathered at the save) and the
layout it saved under: a local checkpoint is read by the same process of the
same mesh; under another layout (a relaunch on fewer hosts, or more) only where
this process's own shards hold every array whole (data parallelism across
hosts), each array then put together and placed anew. It records its run's
config, which a relaunch checks as a resume checks config.json.

Orbax's own per-process checkpointing (the CheckpointManager its emergency
checkpointer builds its local tier from: primary_host None, one active process)
was tried first and left: beside the persistent tier's manager, on two
processes, process 1 wrote the persistent checkpoint's data item before process
0 had made its directory, in every run (Orbax 0.12.8 coordinates directory
creation through signals keyed by an operation id the two managers share);
and Orbax's emergency manager itself keeps no local tier on a single slice.

At a relaunch every process says which local steps it holds, and all agree on
the newest step, newer than the persistent tier's newest, that can be restored:
held by every process, or held by some whose devices hold a replica of every
shard the others lack (data parallelism across processes), which is then sent
to them over the mesh (one summing collective, from one holder per shard). A
step the layout gives no such replica (each process its own fsdp part) falls
back, for all together, to the persistent tier, and the run says why. A local
checkpoint that cannot be read is set aside under `<local_dir>/damaged/`, by the
process that holds it, and the choice is made again; a storage fault is never
taken for damage (trainer/storage/faults.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism.distributed import max_over_processes
from trainer.config.errors import ConfigError, StorageError
from trainer.storage import faults
from trainer.storage.checkpoint import State
from trainer.storage.workdir import path, try_writing

_MOST_STEPS = 16  # local steps a process reports at a relaunch (local_keep is below it)
_RECORD = "local.json"
_PARTIAL = ".partial"


def directory_of(setting: str, workdir: str, run: str) -> str:
    """The run's own folder in the local tier, named after its workdir and its identity: runs may share one
    local_dir, and a new run (in a new workdir or in one made again) never takes another's local checkpoints
    for its own."""
    where = str(path(workdir))
    digest = hashlib.sha256(f"{where}\0{run}".encode()).hexdigest()[:8]
    return os.path.join(os.path.abspath(os.path.expanduser(os.path.expandvars(setting))),
                        f"{os.path.basename(where.rstrip('/')) or 'run'}-{digest}")  # fmt: skip


def check_writable(setting: str, workdir: str, run: str) -> None:
    """Make the run's folder in the local tier now, so a bad checkpoint.local_dir fails before anything
    compiles, in one sentence."""
    try:
        try_writing(directory_of(setting, workdir, run))
    except OSError as e:
        raise ConfigError(
            f"checkpoint.local_dir={setting!r}: cannot write there ({e.strerror or e}); give a writable directory "
            'on this host\'s own disk, or "" for no local tier.'
        ) from e


class LocalTier:
    def __init__(self, setting: str, workdir: str, run: str, keep: int, async_save: bool, mesh, config: dict):
        """`config`: the run's resolved config (as config.json holds it), recorded with every step."""
        self.directory, self.keep, self.async_save = directory_of(setting, workdir, run), keep, async_save
        self.run, self.config = run, config
        self.mesh, self.me = mesh, jax.process_index()
        self._writing: threading.Thread | None = None
        self._pending: int | None = None  # the step being written: kept, as far as the run's account goes
        self._failed: BaseException | None = None
        self._failing = False  # said already, until a save succeeds
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):  # a save a kill cut short: never complete, never read
            if name.endswith(_PARTIAL):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def layout(self) -> dict:
        """What a local checkpoint must have been saved under to be read by this process."""
        return {"processes": jax.process_count(), "mesh": [[n, int(s)] for n, s in self.mesh.shape.items()],
                "devices": [int(d.id) for d in self.mesh.devices.flat if d.process_index == self.me]}  # fmt: skip

    def save(self, step: int, state: State, data_iterator, reset_label: int) -> None:
        """A collective (every process saves at the same steps): the rows' positions are gathered. The shards
        are copied to host memory here; the files are written while training goes on (unless async is off)."""
        rows = _gathered_rows(data_iterator.get_state()["rows"] if data_iterator is not None else {})
        self.wait()
        shards, index = {}, {}
        for i, leaf in enumerate(jax.tree.leaves(_fields(state))):
            for shard in leaf.addressable_shards:
                shards[f"{i}-{shard.device.id}.npy"] = np.asarray(shard.data)
                index[f"{i}-{shard.device.id}.npy"] = _key(shard.index, leaf.shape)
        record = {"step": step, "run": self.run, "config": self.config, "layout": self.layout(), "rows": rows,
                  "reset_optimizer": reset_label, "index": index, "whole": _whole(state)}  # fmt: skip
        self._pending = step
        self._writing = threading.Thread(target=self._write, args=(step, shards, record), daemon=True)
        self._writing.start()
        if not self.async_save:
            self.wait()

    def _write(self, step: int, shards: dict, record: dict) -> None:
        """Written aside and renamed when whole, so a kill mid-save leaves no step that looks complete."""
        try:
            partial = os.path.join(self.directory, f"{step}{_PARTIAL}")
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            record["crc32"] = {}
            for name, array in shards.items():
                encoded = io.BytesIO()
                np.save(encoded, array, allow_pickle=False)
                record["crc32"][name] = zlib.crc32(encoded.getbuffer())
                with open(os.path.join(partial, name), "wb") as f:
                    f.write(encoded.getbuffer())
            with open(os.path.join(partial, _RECORD), "w") as f:
                json.dump(record, f)
            final = os.path.join(self.directory, str(step))
            shutil.rmtree(final, ignore_errors=True)  # this tier's own older copy of the step (a rollback)
            os.rename(partial, final)
            for old in self.steps()[: -self.keep]:  # this tier's retention: the newest `keep`
                shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
        except BaseException as e:  # said at the next save or wait, on the training thread
            self._failed = e

    def wait(self) -> None:
        """Until the save in flight is written. A failed one is said (once until a save succeeds again) and
        training goes on: the workdir's checkpoints are unaffected, and a relaunch uses what the tier holds."""
        if self._writing is not None:
            self._writing.join()
            self._writing = self._pending = None
            if self._failed is None:
                self._failing = False
        if self._failed is not None:
            error, self._failed = self._failed, None
            if not self._failing:
                print(f"process {self.me}: warning: writing the local checkpoint tier in {self.directory} failed "
                      f"({faults.summary(error)}); training goes on, the workdir's checkpoints are unaffected",
                      flush=True)  # fmt: skip
            self._failing = True

    def close(self) -> None:
        self.wait()

    def steps(self) -> list[int]:
        """The complete local steps, and the one being written (it will be, or the launch will not end well)."""
        listed = {int(n) for n in os.listdir(self.directory) if n.isdigit()}
        return sorted(listed | ({self._pending} if self._pending is not None else set()))

    def usable_steps(self) -> tuple[list[int], list[int]]:
        """This process's complete local checkpoints, newest first: those saved under this layout, and those
        saved under another (a relaunch on fewer or more hosts) whose shards on this disk hold every array whole."""
        steps, whole = [], []
        for step in reversed(self.steps()):
            try:
                with open(os.path.join(self.directory, str(step), _RECORD)) as f:
                    record = json.load(f)
                saved = (record["run"], record["layout"])
            except (OSError, ValueError, KeyError):
                saved = None  # unreadable: offered all the same, so that a read sets it aside
            if saved is None or saved == (self.run, self.layout()):
                steps.append(step)
            elif saved[0] == self.run and record.get("whole"):
                whole.append(step)
        return steps[:_MOST_STEPS], whole[:_MOST_STEPS]

    def restore(self, after: int, abstract: State, data_iterator, asked_label: int, say, check):
        """(step, the state's fields as saved, the run's last reset label) from the newest local step newer than
        `after` that every process can restore, the data iterator set in place; None (said, when a newer local
        step existed) to use the persistent tier. `check(config)` raises ConfigError for a step whose recorded
        config this one cannot resume, before the step is taken."""
        while True:
            mine, whole = self.usable_steps()
            held, everywhere = _gathered_steps(mine), set.intersection(*_gathered_steps(whole))
            choice, why = _choose(held, after, abstract)
            other = max((s for s in everywhere if s > max(after, choice[0] if choice else -1)), default=None)
            if other is not None:  # another layout's step, whole on every process: newer than any of this layout
                choice, why = (other, set(range(jax.process_count()))), None
            if choice is None:
                if why:
                    say(why)
                return None
            step, holders = choice
            recorded = _broadcast_json(self._config(step) if self.me in holders else None)
            if recorded is not None:  # checked before a shard is read: a shard of another shape is not damage
                check(recorded)
            tree, record, error = self._read(step, abstract) if self.me in holders else (None, None, None)
            kind = faults.verdict(error) if error is not None else faults.OK
            worst = max_over_processes(kind)
            if worst == faults.DAMAGED:
                if kind == faults.DAMAGED:
                    moved = self._set_aside(step)
                    print(f"process {self.me}: the local checkpoint at step {step} cannot be read "
                          f"({faults.summary(error)}); moved to {moved}", flush=True)  # fmt: skip
                continue
            if worst != faults.OK:
                raise StorageError(faults.stopped(f"reading the local checkpoint at step {step} in {self.directory}",
                                                  error, worst, 0))  # fmt: skip
            saved = _broadcast_json(record)  # every row's data position, and the run's last reset label
            done = int(saved["reset_optimizer"])
            if asked_label and asked_label != done:  # a new checkpoint.reset_optimizer: the persistent path resets
                say(f"the local checkpoint at step {step} is left for the persistent tier: checkpoint.reset_optimizer "
                    "asks for a fresh optimiser state")  # fmt: skip
                return None
            tree = _completed(tree, holders, abstract, self.mesh)
            if data_iterator is not None:
                data_iterator.set_state({"rows": saved["rows"]})
            how = "" if len(holders) == jax.process_count() else (
                f", the processes without it ({sorted(set(range(jax.process_count())) - holders)}) given their "
                "share by the processes holding its replicas")  # fmt: skip
            say(f"resuming from the local checkpoint at step {step} in {self.directory}{how}")
            return step, tree, done

    def _config(self, step: int) -> dict | None:
        """The config a local step recorded; None where its record cannot be read (the read then says why)."""
        try:
            with open(os.path.join(self.directory, str(step), _RECORD)) as f:
                return json.load(f)["config"]
        except (OSError, ValueError, KeyError):
            return None

    def _read(self, step: int, abstract: State):
        """(the state's fields, the step's record, None) or (None, None, the error): this process's shards."""
        folder = os.path.join(self.directory, str(step))
        try:
            with open(os.path.join(folder, _RECORD)) as f:
                record = json.load(f)
            flat, structure = jax.tree.flatten(_fields(abstract))
            if record["layout"] != self.layout():  # saved on other hosts: each array whole from this disk's shards
                return jax.tree.unflatten(structure, _reshard(folder, record, flat)), record, None
            leaves = []
            for i, leaf in enumerate(flat):
                pieces = []
                for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
                    name = f"{i}-{device.id}.npy"
                    with open(os.path.join(folder, name), "rb") as f:
                        data = f.read()
                    if zlib.crc32(data) != record["crc32"].get(name):
                        raise faults.Damaged(f"{name} in {folder} does not hold what was written")
                    array = np.load(io.BytesIO(data), allow_pickle=False)
                    if array.shape != _shape(index, leaf.shape) or array.dtype != leaf.dtype:
                        raise faults.Damaged(f"{name} in {folder} holds {array.dtype}{list(array.shape)}")
                    pieces.append(jax.device_put(array, device))
                leaves.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces))
            return jax.tree.unflatten(structure, leaves), record, None
        except (ValueError, KeyError, EOFError) as e:  # a record or file that is not what was written
            return None, None, faults.Damaged(f"{folder}: {type(e).__name__}: {e}")
        except OSError as e:
            return None, None, e

    def rolled_back_to(self, step: int) -> None:
        """After a rollback to `step`: the local steps past it (the trajectory left) are moved to
        <local_dir>/rolled_back/, as the workdir's are, so that no relaunch resumes from them."""
        self.wait()
        for later in [s for s in self.steps() if s > step]:
            self._set_aside(later, "rolled_back")

    def _set_aside(self, step: int, folder: str = "damaged") -> str:
        """Moved into <local_dir>/<folder>/, never deleted, by the process whose disk holds it."""
        target, suffix = os.path.join(self.directory, folder, str(step)), 0
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(self.directory, folder, f"{step}.{suffix}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(os.path.join(self.directory, str(step)), target)
        return target


def _fields(state: State) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def _gathered_steps(mine: list[int]) -> list[set[int]]:
    """Every process's local steps (a collective)."""
    if jax.process_count() == 1:
        return [set(mine)]
    padded = np.full(_MOST_STEPS, -1, np.int64)
    padded[: len(mine)] = mine
    return [{int(s) for s in row if s >= 0} for row in np.asarray(multihost_utils.process_allgather(padded))]


def _gathered_bytes(mine: bytes) -> list[bytes]:
    """Every process's `mine` (a collective)."""
    if jax.process_count() == 1:
        return [mine]
    lengths = np.asarray(multihost_utils.process_allgather(np.array(len(mine), np.int64)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(mine)] = np.frombuffer(mine, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [bytes(row[:n]) for row, n in zip(rows, lengths, strict=True)]


def _gathered_rows(mine: dict) -> dict:
    """Every process's batch rows' data positions, merged: any holder of a local step can give them all."""
    merged = {}
    for part in _gathered_bytes(json.dumps(mine).encode()):
        merged.update(json.loads(part))
    return merged


def _broadcast_json(value):
    """The first holder's `value` on every process (a collective; non-holders give None); None if none did."""
    for part in _gathered_bytes(json.dumps(value).encode() if value is not None else b""):
        if part:
            return json.loads(part)
    return None


def _choose(held: list[set[int]], after: int, abstract: State):
    """((step, its holders) or None, why not the newest local step): the same on every process."""
    everyone = set(range(len(held)))
    newer = sorted({s for steps in held for s in steps if s > after}, reverse=True)
    for step in newer:
        holders = {p for p in everyone if step in held[p]}
        if holders == everyone or _replicated_for(holders, abstract):
            return (step, holders), None
    if not newer:
        return None, None
    lacking = sorted(p for p in everyone if newer[0] not in held[p])
    return None, (
        f"the local checkpoint at step {newer[0]} is missing on process{'es' * (len(lacking) > 1)} "
        f"{', '.join(map(str, lacking))}, and no other process holds a replica of "
        f"{'their' if len(lacking) > 1 else 'its'} share (the mesh gives each process its own part of the "
        f"sharded state); all resume from the persistent checkpoint"
        + (f" at step {after}" if after >= 0 else "s (there are none: a fresh start)")
    )


def _replicated_for(holders: set[int], abstract: State) -> bool:
    """Whether, for every array, each shard a non-holder's device needs is on some holder's device."""
    for leaf in jax.tree.leaves(_fields(abstract)):
        indices = leaf.sharding.devices_indices_map(leaf.shape)
        have = {_key(i) for d, i in indices.items() if d.process_index in holders}
        if any(_key(i) not in have for d, i in indices.items() if d.process_index not in holders):
            return False
    return True


def _key(index, shape: tuple | None = None) -> tuple:
    """A shard's index as (start, stop) per dimension (with `shape`, open ends made explicit)."""
    given = shape is not None
    return tuple(s.indices(n)[:2] if given else (s.start, s.stop) for s, n in zip(index, shape or index, strict=True))


def _whole(state: State) -> bool:
    """Whether this process's shards hold every array whole (a sharding's distinct shards tile their array)."""
    for leaf in jax.tree.leaves(_fields(state)):
        distinct = {_key(s.index, leaf.shape) for s in leaf.addressable_shards}
        if sum(int(np.prod([b - a for a, b in k])) for k in distinct) != leaf.size:
            return False
    return True


def _reshard(folder: str, record: dict, flat: list) -> list:
    """Each array of a step saved under another layout, put together whole from this process's shards (their
    CRCs checked) and placed on this layout's devices."""
    leaves = []
    for i, leaf in enumerate(flat):
        whole = np.empty(leaf.shape, leaf.dtype)
        for name, index in record["index"].items():
            if name.split("-")[0] != str(i):
                continue
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            if zlib.crc32(data) != record["crc32"].get(name):
                raise faults.Damaged(f"{name} in {folder} does not hold what was written")
            where = tuple(slice(a, b) for a, b in index)
            whole[where] = np.load(io.BytesIO(data), allow_pickle=False)
        leaves.append(jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda at, w=whole: w[at]))
    return leaves


def _completed(tree, holders: set[int], abstract: State, mesh):
    """Every process's arrays of a step some processes restored: each shard sent from one holder's device to
    the devices that lack it, by a sum over the mesh axes the array is replicated along (all others add 0)."""
    if len(holders) == jax.process_count():
        return tree
    flat, structure = jax.tree.flatten(_fields(abstract))
    mine = jax.tree.leaves(tree) if tree else None
    out = []
    for i, leaf in enumerate(flat):
        sharding = leaf.sharding
        indices = sharding.devices_indices_map(leaf.shape)
        if mine is not None:
            have = mine[i]
        else:
            have = jax.make_array_from_callback(
                leaf.shape, sharding, lambda idx, leaf=leaf: np.zeros(_shape(idx, leaf.shape), leaf.dtype)
            )
        out.append(_sent(have, _sources(indices, holders, mesh), sharding, mesh))
    return jax.tree.unflatten(structure, out)


def _shape(index, shape) -> tuple:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _sources(indices: dict, holders: set[int], mesh) -> jax.Array:
    """A bool per device of the mesh: whether it sends its shard (the first holder's device for each shard)."""
    chosen, mask = set(), np.zeros(mesh.devices.shape, bool)
    for position, device in np.ndenumerate(mesh.devices):
        key = _key(indices[device])
        if device.process_index in holders and key not in chosen:
            chosen.add(key)
            mask[position] = True
    every = NamedSharding(mesh, P(*mesh.axis_names))
    return jax.make_array_from_callback(mask.shape, every, lambda idx: mask[idx])


def _sent(value: jax.Array, sources: jax.Array, sharding, mesh) -> jax.Array:
    spec = sharding.spec
    used = {a for part in spec for a in ((part,) if isinstance(part, str) else (part or ()))}
    replicated = tuple(a for a in mesh.axis_names if a not in used)
    if not replicated:
        return value

    def body(x, send):
        kept = jnp.where(send.reshape(()), x, jnp.zeros_like(x))
        if x.dtype == jnp.bool_:  # a sum of flags: one is the sender's, the rest are False
            return jax.lax.psum(kept.astype(jnp.int32), replicated).astype(jnp.bool_)
        return jax.lax.psum(kept, replicated)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(*mesh.axis_names)), out_specs=spec, check_vma=False)
    return jax.jit(fn, out_shardings=sharding)(value, sources)
