"""Faults of a run's surroundings lose nothing: a bucket that refuses, one that answers 503 for a while,
a restore that runs out of device memory; only a checkpoint whose own bytes are bad is set aside.

The faults come from outside the trainer: the storage emulator answers with the status a real bucket
would (tests/gcs_emulator.py), and the out-of-memory error is raised by Orbax's restore, patched in
through a sitecustomize module on the PYTHONPATH of the training processes.
"""

import os
import re
import subprocess
import sys
import threading
import time

import fsspec
import jax
import pytest
from conftest import REPO, cli_args, micro_config
from gcs_emulator import fault

from trainer.config.errors import ConfigError, StorageError
from trainer.storage import faults

OOM = """
import os
if os.environ.get("TRAINER_PROCESS_ID", "0") in os.environ.get("RESTORE_OOM_ON", "").split(","):
    import jax
    import orbax.checkpoint as ocp

    def restore(self, *args, **kwargs):  # where a restore places the arrays it read on the devices
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.")

    ocp.StandardCheckpointHandler.restore = restore
"""


def command(workdir: str, processes: int, steps: int) -> list[str]:
    cfg = micro_config(train=dict(steps=steps, log_every=1), checkpoint={"every_steps": 2, "keep": 5})
    train = [sys.executable, "scripts/train.py", *cli_args(cfg), f"--workdir={workdir}"]
    if processes == 1:
        return train
    return [sys.executable, "scripts/launch_local.py", "-n", str(processes), "--devices_per_process", "4", "--", *train]


def launch(workdir, processes, steps, env=None):
    return subprocess.run(command(workdir, processes, steps), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip


def objects(prefix: str) -> dict[str, bytes]:
    """Every object under a bucket prefix, by its path below it (a fresh listing each time)."""
    fs = fsspec.filesystem("gs", use_listings_cache=False, skip_instance_cache=True)
    names = fs.find(prefix)
    return {name[len(prefix) :]: fs.cat(name) for name in names}


# Both in pytest -m slow: the two-process drill's seven launches took 97 s of the suite's time (2026-11-29), over
# tests/time_limit.py's 90; one process runs a subset of it (the two add "failed on another process").
@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_storage_and_memory_faults_move_nothing_and_damage_is_set_aside(bucket, tmp_path, processes):
    root = f"runs/faults{processes}"
    workdir = f"gs://{root}"
    first = launch(workdir, processes, steps=6)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = {step: objects(f"{root}/checkpoints/{step}") for step in (2, 4, 6)}
    assert all(saved.values())
    history = objects(f"{root}/metrics.jsonl")

    def nothing_moved():
        assert {step: objects(f"{root}/checkpoints/{step}") for step in saved} == saved
        assert not objects(f"{root}/damaged_checkpoints")
        assert objects(f"{root}/metrics.jsonl") == history

    # A bucket that refuses every request (403): one sentence, before anything is read or written.
    fault(bucket.port, 403)
    try:
        refused = launch(workdir, processes, steps=8)
    finally:
        fault(bucket.port, 0)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "failed (OSError: Forbidden" in out
    assert "nothing was moved or deleted; check the path, the credentials" in out
    assert "Traceback" not in out and "SIGTERM" not in out  # the other process ends with the sentence, unkilled
    nothing_moved()

    # Refused on the checkpoint's array files alone, the rest of it read: the same sentence, and nothing of the
    # libraries winding down before or after it (gcsfs's and Orbax's logged errors, TensorStore's late reads on
    # Orbax's closed event loop: "RuntimeError: Event loop is closed", seen on one launch of four before).
    fault(bucket.port, 403, only=f"faults{processes}/checkpoints/6/meta/d/")
    try:
        arrays = launch(workdir, processes, steps=8)
    finally:
        fault(bucket.port, 0)
    out = arrays.stdout + arrays.stderr
    assert arrays.returncode != 0 and "PERMISSION_DENIED" in out
    assert "nothing was moved or deleted; check the path, the credentials" in out
    assert "Traceback" not in out and "Event loop" not in out
    assert not re.search(r"^(\[\d\] )?[IWEF]\d{4} \d\d:\d\d", out, re.M), out  # no library's log line
    if processes == 1:
        assert arrays.stderr.strip().splitlines() == [line for line in out.splitlines() if line.startswith("error:")]
    nothing_moved()

    # A restore that runs out of device memory (on process 1 of 2, or the only one): every process stops.
    (tmp_path / "sitecustomize.py").write_text(OOM)
    env = {"PYTHONPATH": str(tmp_path), "RESTORE_OOM_ON": str(processes - 1)}
    oom = launch(workdir, processes, steps=8, env=env)
    out = oom.stdout + oom.stderr
    assert oom.returncode != 0
    assert "RESOURCE_EXHAUSTED: Out of memory" in out and "restore onto more devices" in out
    assert "Traceback" not in out and "cannot be read" not in out
    if processes == 2:
        assert "failed on another process" in out  # process 0 read its part; it stops with process 1
    nothing_moved()

    # The bucket answers 503 for a while after the run starts: the run waits, then resumes.
    fault(bucket.port, 503)
    threading.Timer(8.0, fault, (bucket.port, 0)).start()
    started = time.monotonic()
    recovered = launch(workdir, processes, steps=8)
    assert recovered.returncode == 0, recovered.stdout[-3000:] + recovered.stderr[-3000:]
    assert time.monotonic() - started > 8
    assert "resumed from the checkpoint at step 6" in recovered.stdout
    assert not objects(f"{root}/damaged_checkpoints")

    # A truly truncated file: that checkpoint alone is set aside, whole, and the one before it resumes.
    fs = fsspec.filesystem("gs", use_listings_cache=False, skip_instance_cache=True)
    newest = objects(f"{root}/checkpoints/8")
    data_files = sorted((n for n in newest if "/params/" in n and "/d/" in n), key=lambda n: len(newest[n]))
    victim = data_files[-1]
    fs.pipe(f"{root}/checkpoints/8{victim}", newest[victim][: len(newest[victim]) // 2])
    newest[victim] = newest[victim][: len(newest[victim]) // 2]
    damaged = launch(workdir, processes, steps=10)
    assert damaged.returncode == 0, damaged.stdout[-3000:] + damaged.stderr[-3000:]
    assert "checkpoint at step 8 cannot be read" in damaged.stdout
    assert "resumed from the checkpoint at step 6" in damaged.stdout
    assert objects(f"{root}/damaged_checkpoints/8") == newest  # every byte, in one place


class Flaky:
    """A read of a checkpoint that fails as TensorStore's does while a bucket is unavailable, `times` times."""

    def __init__(self, ckpt, times: int, error: str):
        self.ckpt, self.times, self.error, self.calls = ckpt, times, error, 0

    def __call__(self, step):
        return self.ckpt._read(step, lambda: self._work(step))

    def _work(self, step):
        self.calls += 1
        if self.calls <= self.times:
            raise ValueError(self.error)
        return f"state at {step}"


def test_transient_trouble_is_retried_and_outlasting_trouble_stops_with_everything_in_place(tmp_path):
    from test_checkpoint import _save_steps

    from trainer.storage.checkpoint import Checkpointer

    _, _, ckpt = _save_steps(tmp_path, steps=(1, 2))
    said = []
    unavailable = 'UNAVAILABLE: Error reading "gs://runs/x/2/params/manifest.ocdbt": HTTP response code: 503'
    flaky = Flaky(ckpt, 2, unavailable)
    assert ckpt.restore_newest_intact(flaky, said.append, retry_seconds=30) == (2, "state at 2")
    assert flaky.calls == 3 and sum("retrying in" in s for s in said) == 2

    with pytest.raises(StorageError, match="kept failing for 1 s .checkpoint.retry_seconds.; rerun once it answers"):
        ckpt.restore_newest_intact(Flaky(ckpt, 100, unavailable), said.append, retry_seconds=1)
    with pytest.raises(StorageError, match="PERMISSION_DENIED.*check the path, the credentials"):
        ckpt.restore_newest_intact(Flaky(ckpt, 1, "PERMISSION_DENIED: HTTP response code: 403"), said.append, 30)
    assert Checkpointer(str(tmp_path / "checkpoints")).steps() == [1, 2]
    assert not (tmp_path / "damaged_checkpoints").exists()
    ckpt.close()


@pytest.mark.parametrize(
    "error,kind",
    [
        (ValueError('OUT_OF_RANGE: Error reading "w/0.1" in OCDBT database: Requested byte range [95346, 97290)'),
         faults.DAMAGED),
        (ValueError('NOT_FOUND: Metadata at "embed/.zarray" in OCDBT database does not exist'), faults.DAMAGED),
        (FileNotFoundError("runs/x/checkpoints/3/meta/_METADATA"), faults.DAMAGED),
        (ValueError("DATA_LOSS: Error decoding manifest"), faults.DAMAGED),
        (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB."),
         faults.STOP),
        (OSError("Forbidden: runs/x/checkpoints\nPermission denied"), faults.STOP),
        (ValueError("UNAUTHENTICATED: HTTP response code: 401"), faults.STOP),
        (ValueError("UNAVAILABLE: HTTP response code: 503 with body: Service Unavailable"), faults.TRANSIENT),
        (TimeoutError("timed out"), faults.TRANSIENT),
        (ConnectionRefusedError(111, "Connection refused"), faults.TRANSIENT),
        (RuntimeError("something nobody has seen"), faults.STOP),
    ],
)  # fmt: skip
def test_errors_are_told_apart(error, kind):
    wrapped = Exception("Encountered error while reading array index: (slice(0, 503, 1),)")
    wrapped.__cause__ = error
    assert faults.verdict(error) == kind
    assert faults.verdict(wrapped) == kind  # Orbax's bare Exception around the real one


def test_a_gone_bucket_is_one_sentence(bucket):
    from trainer.storage import workdir as wd

    with pytest.raises(ConfigError, match="the bucket gs://nosuchbucket does not exist"):
        wd.wait_for_storage("gs://nosuchbucket/run", 5, print)


@pytest.mark.slow  # an exhaustive drill (every object of a checkpoint); CI's 25 minutes: 24:27 on 2026-11-26
def test_a_set_aside_interrupted_at_any_object_leaves_one_whole_copy(bucket):
    """In a bucket a move is many requests: copies, checks, deletes. The storage refuses from the k-th on,
    for k inside each of those phases, then answers again: the relaunch resumes from the previous
    checkpoint, and the damaged one is byte for byte in one folder. Run in a process of its own, as a
    training run would be: the TensorStore it drives against the emulator ends with it."""
    drill = subprocess.run([sys.executable, "tests/test_faults.py", str(bucket.port)], cwd=REPO,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert drill.returncode == 0 and drill.stdout.strip().endswith("moves checked"), (
        drill.stdout[-3000:] + drill.stderr[-3000:]
    )


def interrupted_moves(port: int) -> None:
    from types import SimpleNamespace

    from test_checkpoint import _restorer

    from trainer.storage import workdir as wd
    from trainer.storage.checkpoint import Checkpointer
    from trainer.training.setup import build

    bucket = SimpleNamespace(port=port)
    cfg = micro_config(mesh=dict(fsdp=8))
    setup = build(cfg)
    state = setup.new_state()
    fs = fsspec.filesystem("gs", use_listings_cache=False, skip_instance_cache=True)
    for phase in (0.0, 0.5, 1.5, 3.0, 3.5):  # n copies, 2n checks, n deletes: (first, mid) copy, check, delete
        root = f"runs/move{phase}"
        ckpt = Checkpointer(f"gs://{root}/checkpoints", keep=5)
        for step in (1, 2):
            ckpt.save(step, state.replace(step=state.step + step), None)
        ckpt.wait()
        victim = max((n for n in fs.find(f"{root}/checkpoints/2/params") if "/d/" in n), key=lambda n: fs.size(n))
        fs.pipe(victim, fs.cat(victim)[:100])
        damaged = objects(f"{root}/checkpoints/2")

        fault(bucket.port, 403, after=2 + int(phase * len(damaged)))  # 2: the listings before the copies
        try:
            with pytest.raises(StorageError, match="nothing is lost"):
                ckpt.set_aside(2, "damaged_checkpoints")
        finally:
            fault(bucket.port, 0)
        ckpt.close()
        wd.forget_listings(f"gs://{root}")

        ckpt = Checkpointer(f"gs://{root}/checkpoints", keep=5)  # the relaunch
        step, restored = ckpt.restore_newest_intact(_restorer(cfg, setup, ckpt), print, 0)
        assert step == 1 and int(restored.step) == 1 and ckpt.steps() == [1]
        folders = ("checkpoints/2", "damaged_checkpoints/2", "damaged_checkpoints/2.1")
        assert damaged in [objects(f"{root}/{folder}") for folder in folders], phase
        ckpt.close()
    print("moves checked")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


@pytest.mark.slow  # two-process kill drill, 19 s (2026-12-06): room for the suite's 10 minutes
def test_a_data_worker_killed_mid_run_ends_the_run_in_one_sentence(tmp_path, corpus_dir):
    """data.workers=2 read the rows in processes of their own; one is killed from outside: the run stops
    with a sentence naming the worker, its pid and exit status, and leaves no worker behind."""
    import signal

    cfg = micro_config(data=dict(source="text_files", data_dir=corpus_dir, workers=2),
                       train=dict(steps=400, log_every=1), checkpoint={"every_steps": 100})  # fmt: skip
    workdir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "scripts/train.py", *cli_args(cfg), f"--workdir={workdir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (workdir / "metrics.jsonl").exists() or not (workdir / "metrics.jsonl").read_text().count("\n") >= 3:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    workers = [p for p in children(proc.pid) if "spawn" in open(f"/proc/{p}/cmdline").read()]
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"error: data worker 1 (pid {workers[1]}) exited with code -9 while reading rows" in out, out[-2000:]
    assert "Traceback" not in out
    assert not any(os.path.exists(f"/proc/{p}") for p in workers)


if __name__ == "__main__":  # the interrupted-move drill, started by its test with the emulator's environment
    interrupted_moves(int(sys.argv[1]))
