"""A lost host and its return, with processes as hosts (scripts/launch_local.py --elastic): the run goes on by
itself on three of four, keeps its global batch by accumulation, and takes the fourth back at a checkpoint."""

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, cli_args, data_state, micro_config

from trainer.config.errors import ConfigError
from trainer.run import elastic
from trainer.run.loop import train


def _config(corpus_dir):
    """Data parallelism across hosts, FSDP within each (2 devices): a lost host takes a replica, not a shard."""
    return micro_config(data=dict(source="text_files", data_dir=corpus_dir), mesh=dict(data=-1, fsdp=2),
                        train=dict(steps=14, global_batch_size=24, log_every=1),
                        checkpoint={"every_steps": 4, "keep": 20})  # fmt: skip


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _wait(condition, proc, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the launcher ended before {what}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.1)


def _steps(workdir):
    try:
        return [r for r in _records(workdir) if "loss" in r]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


@pytest.mark.slow
def test_a_host_lost_mid_run_and_brought_back_keeps_the_run_the_straight_run(tmp_path, corpus_dir):
    """4 hosts x 2 devices, 24 sequences a step. Host 3 goes down after step 5: the launcher relaunches on hosts
    0-2 with nobody acting, the run resumes from the survivors' local checkpoint tier with train.grad_accum_steps
    2 (24 over 6 devices at 2 a device, as 8 had 3), and logs the relaunch with its cause and cost. Host 3
    answers again: the run saves, stops and goes on with all four. Every step is logged once, every loss equals
    the straight one-process run's, and each document stream ends where the straight run leaves it."""
    cfg = _config(corpus_dir)
    straight, workdir, down = str(tmp_path / "straight"), str(tmp_path / "elastic"), tmp_path / "down"
    train(cfg, straight)
    down.mkdir()
    log = open(tmp_path / "launch.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "scripts/launch_local.py", "-n", "4", "--devices_per_process", "2", "--elastic", str(down),
         "--", sys.executable, "scripts/train.py", *cli_args(cfg), f"--workdir={workdir}",
         f"--config.checkpoint.local_dir={tmp_path}/local/$TRAINER_HOST", "--config.checkpoint.local_every_steps=1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait(lambda: len(_steps(workdir)) >= 5, proc, "step 5")
        killed_after = max(r["step"] for r in _steps(workdir))
        (down / "3").touch()  # host 3 goes down: the launcher ends its process as the machine's end would
        relaunched = lambda n: sum(r.get("event") == "relaunch" for r in _records(workdir)) >= n  # noqa: E731
        _wait(lambda: relaunched(1), proc, "relaunch on three hosts")
        back_at = max(r["step"] for r in _records(workdir)) + 2
        _wait(lambda: max(r["step"] for r in _steps(workdir)) >= back_at, proc, "steps on three hosts")
        (down / "3").unlink()  # host 3 answers again
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = open(tmp_path / "launch.log").read()
    assert "Traceback" not in out, out[-3000:]
    assert "launch_local: host 3 (its process ended by SIGKILL) lost: relaunching on 3 of 4 hosts (0, 1, 2)" in out
    assert "launch_local: host 3 answers again: relaunching on 4 of 4 hosts (0, 1, 2, 3)" in out
    assert (
        "elastic: 3 of 4 hosts answer (6 devices): the global batch of 24 kept by train.grad_accum_steps 1 -> 2" in out
    )

    records = _records(workdir)
    events = [r for r in records if r.get("event") == "relaunch"]
    assert [(e["cause"], e["hosts"], e["devices"], e["grad_accum_steps"]) for e in events] == [
        ("host 3 (its process ended by SIGKILL) lost", 3, 6, 2),
        ("host 3 answers again", 4, 8, 1),
    ]
    assert all(e["goodput_lost_seconds"] > 0 for e in events)
    # The first relaunch resumed from the survivors' local tier (each host holds a replica of every array, saved
    # under the four hosts' layout), past the persistent checkpoint at step 4; the second from the checkpoint
    # the run saved for host 3's return.
    local = re.search(r"\[0\] resuming from the local checkpoint at step (\d+)", out)
    assert local and 4 < int(local.group(1)) == events[0]["step"] <= killed_after, out[-3000:]
    assert events[1]["step"] >= back_at
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 15))  # no step counted twice (the superseded ones moved aside), none missing
    expected = {r["step"]: r["loss"] for r in _records(straight) if "loss" in r}
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r], [expected[s] for s in steps], rtol=2e-5)
    assert data_state(workdir, 14) == data_state(straight, 14)


def test_the_global_batch_is_kept_over_the_devices_or_slices_that_answer_or_refused_in_one_sentence(monkeypatch):
    """3 of 4 hosts of 2 devices: 24 sequences go on 6 devices by accumulating 2 microbatches of 12 (2 a device,
    at most the 3 the full set gave each), over hosts as data replicas or as slices (mesh.dcn_data 4 -> 3). A
    batch no accumulation can make, and slices that are not one host each, are one sentence."""
    said = []
    say = lambda line, **_: said.append(line)  # noqa: E731
    monkeypatch.setenv("TRAINER_ELASTIC_HOSTS", "3/4")
    for mesh in (dict(data=-1, fsdp=2), dict(data=1, fsdp=2, dcn_data=4)):
        kept = elastic.keep_global_batch(micro_config(mesh=mesh, train=dict(global_batch_size=24)), say, 6)
        assert kept.train.grad_accum_steps == 2 and kept.mesh.dcn_data == (3 if "dcn_data" in mesh else 1)
    assert said[-2:] == ["elastic: 3 of 4 slices answer: mesh.dcn_data 4 -> 3",
                         "elastic: 3 of 4 hosts answer (6 devices): the global batch of 24 kept by "
                         "train.grad_accum_steps 1 -> 2"]  # fmt: skip
    slices = r"an elastic run over slices takes one host a slice along mesh.dcn_data alone: mesh.dcn_data=2, "
    with pytest.raises(ConfigError, match=slices + r"dcn_fsdp=1 and dcn_context=1 on 4 hosts"):
        elastic.keep_global_batch(micro_config(mesh=dict(data=2, fsdp=2, dcn_data=2)), say, 6)
    monkeypatch.setenv("TRAINER_ELASTIC_HOSTS", "4/5")  # 8 devices of 10: 20 sequences were 2 a device
    with pytest.raises(ConfigError, match=r"the global batch of 20 sequences cannot be made on the 8 devices of the "
                                          r"4 hosts of 5 that answer: .* a multiple of 8\."):  # fmt: skip
        elastic.keep_global_batch(micro_config(mesh=dict(data=-1, fsdp=2), train=dict(global_batch_size=20)),
                                  say, 8)  # fmt: skip
