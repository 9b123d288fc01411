"""A workdir is one run (trainer/storage/lease.py): a second launch while the first holds it is one sentence and
writes nothing; a killed launch leaves nothing held, on a local disk and in a bucket."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, cli_args, micro_config

from trainer.config.errors import ConfigError
from trainer.storage import lease as leases
from trainer.storage.lease import Lease


@pytest.mark.slow  # launches and a kill, 13 s (2026-12-06): room for the suite's 10 minutes
def test_a_second_launch_in_a_held_local_workdir_is_one_sentence_and_a_killed_holder_holds_nothing(tmp_path):
    workdir = tmp_path / "run"
    command = [sys.executable, "scripts/train.py", *cli_args(micro_config(train=dict(steps=2))),
               f"--workdir={workdir}"]  # fmt: skip
    # The holder: another process that took the lease and stays (as a training launch would).
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from trainer.storage.lease import Lease; held = Lease.take(sys.argv[2]); print('held', "
                               "flush=True); time.sleep(600)", REPO, str(workdir)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    os.makedirs(workdir / "checkpoints")
    assert holder.stdout.readline().strip() == "held"
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [
        f"error: {workdir} is in use by another launch of this run (another process holds its lock): wait for it to "
        "end, or give this run another --workdir."
    ]
    assert os.listdir(workdir) == ["checkpoints"] and os.listdir(workdir / "checkpoints") == []
    holder.send_signal(signal.SIGKILL)  # killed: the kernel lets go of its lock
    holder.wait()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    Lease.take(str(workdir)).release()  # and the finished run let go of it too


def test_a_buckets_lease_refuses_a_second_launch_lapses_when_its_holder_is_killed_and_ends_with_the_run(bucket):
    import fsspec

    fs, workdir = fsspec.filesystem("gcs"), f"{bucket.url}/leased"
    first = Lease.take(workdir)
    with pytest.raises(ConfigError, match=rf"^{workdir} is in use by another launch of this run \(process "
                       rf"{os.getpid()} on .*; its lease renewed \d+ s ago, and a killed launch's lapses after 120 s\)"
                       ": wait for it to end"):  # fmt: skip
        Lease.take(workdir)
    first.release()
    assert not fs.exists(f"{workdir}/lease.json")
    # A killed launch's lease, last renewed longer ago than it lapses after, is taken over.
    fs.invalidate_cache()
    stale = {"host": "gone", "pid": 1, "since": 0, "renewed": time.time() - leases.LAPSE_S - 1}
    fs.pipe_file(f"{workdir}/lease.json", json.dumps(stale).encode())
    taken = Lease.take(workdir)
    assert json.loads(fs.cat_file(f"{workdir}/lease.json"))["pid"] == os.getpid()
    taken.release()
    # A fresh lease whose holder ran on this host and has ended (a job killed and relaunched on its VM) is taken
    # over at once; a fresh one of a live process on another host is not.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    for host, pid, taken_over in [(socket.gethostname(), ended.pid, True), ("elsewhere", ended.pid, False)]:
        fs.invalidate_cache()
        fresh = {"host": host, "pid": pid, "since": time.time(), "renewed": time.time()}
        fs.pipe_file(f"{workdir}/lease.json", json.dumps(fresh).encode())
        if taken_over:
            Lease.take(workdir).release()
        else:
            with pytest.raises(ConfigError, match="is in use by another launch"):
                Lease.take(workdir)
