"""The local checkpoint tier (trainer/storage/local_tier.py): real processes killed between persistent saves
resume from each process's own disk and end with an uninterrupted run's weights, bit for bit."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import REPO, cli_args, micro_config
from test_multiprocess import launch, text

from trainer.storage import workdir as wd
from trainer.storage.checkpoint import Checkpointer
from trainer.training.setup import build
from trainer.training.state import abstract_params

STEPS = 14


def run_config(**mesh):
    cfg = micro_config(train=dict(steps=STEPS, log_every=1),
                       checkpoint={"every_steps": 50, "keep": 2, "local_every_steps": 2})  # fmt: skip
    cfg.mesh.update(mesh)
    return cfg


def final_params(workdir, cfg):
    setup = build(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    assert ckpt.latest_step() == STEPS
    params = jax.device_get(ckpt.restore_params(STEPS, abstract_params(setup.model, setup.shard)))
    ckpt.close()
    return params


def assert_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def folder(local):
    """The run's own folder in a local_dir (one run here)."""
    found = [p for p in local.iterdir() if p.is_dir()] if local.is_dir() else []
    assert len(found) <= 1, found
    return found[0] if found else local / "none-yet"


def committed(local) -> list[int]:
    mine = folder(local)
    return sorted(int(n) for n in os.listdir(mine) if n.isdigit()) if mine.is_dir() else []


@pytest.mark.slow  # kill-and-relaunch drill, 27 s (2026-12-06): room for the suite's 10 minutes
def test_a_kill_between_persistent_saves_resumes_from_the_local_tier_and_damage_there_is_set_aside(tmp_path):
    cfg = run_config()
    train = [sys.executable, "scripts/train.py", *cli_args(cfg)]
    straight = subprocess.run([*train, f"--workdir={tmp_path / 'straight'}"], cwd=REPO, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]

    local, workdir = tmp_path / "local", tmp_path / "run"
    command = [*train, f"--workdir={workdir}", f"--config.checkpoint.local_dir={local}"]

    def killed_once(past: int) -> int:
        """Run until the local tier has a step beyond `past`, SIGKILL; returns the newest committed local step."""
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 200
        while proc.poll() is None and not [s for s in committed(local) if s > past] and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return committed(local)[-1]

    first = killed_once(4)
    assert not os.listdir(workdir / "checkpoints")  # no persistent save yet: it saves at the end alone
    resumed = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Watched until it has saved locally past where it resumed, then killed again.
    deadline = time.time() + 200
    while resumed.poll() is None and committed(local)[-1] <= first + 2 and time.time() < deadline:
        time.sleep(0.01)
    resumed.send_signal(signal.SIGKILL)
    out, _ = resumed.communicate()
    assert f"resuming from the local checkpoint at step {first} in {local}" in out, out[-2000:]

    # The newest local step damaged (a data file cut short): set aside, and the one before it resumed.
    steps = committed(local)
    newest, before = steps[-1], steps[-2]
    data = max((folder(local) / str(newest)).glob("*.npy"), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    final = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout[-2000:] + final.stderr[-2000:]
    assert not final.stderr.strip(), final.stderr[-2000:]  # no library's words about the failed read
    assert f"the local checkpoint at step {newest} cannot be read" in final.stdout, final.stdout[-2000:]
    assert os.path.isdir(folder(local) / "damaged" / str(newest))
    assert f"resuming from the local checkpoint at step {before}" in final.stdout, final.stdout[-2000:]
    assert_equal(final_params(workdir, cfg), final_params(tmp_path / "straight", cfg))


@pytest.mark.slow  # six launches of two processes: pytest -m slow
@pytest.mark.parametrize("mesh, peers", [(dict(data=1, fsdp=-1), False), (dict(data=2, fsdp=4), True)])
def test_two_processes_one_relaunched_with_its_local_tier_wiped(tmp_path, mesh, peers):
    """Each process has its own local_dir (the launcher's process id in the path). Process 1's is wiped
    before the relaunch: with the state fully sharded over both, all go back to the persistent tier together
    and say why; with a data axis across the processes, process 0 holds a replica of every shard process 1
    lacks, so both resume from the local step. Either way, the uninterrupted run's weights, bit for bit."""
    cfg = run_config(**mesh)
    plain = [*cli_args(cfg), "--config.checkpoint.every_steps=6"]
    base = [*plain, f"--config.checkpoint.local_dir={tmp_path}/local/$TRAINER_PROCESS_ID"]
    procs, logs = launch([*plain, f"--workdir={tmp_path / 'straight'}"], tmp_path / "straight-logs")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], text(logs[0])[-2000:] + text(logs[1])[-2000:]

    workdir = tmp_path / "run"
    procs, logs = launch([*base, f"--workdir={workdir}"], tmp_path / "killed-logs")
    deadline = time.time() + 300
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        if all(max(committed(tmp_path / "local" / str(i)), default=0) >= 10 for i in range(2)):
            break
        time.sleep(0.01)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    local_step = min(committed(tmp_path / "local" / str(i))[-1] for i in range(2))
    persistent = max(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
    assert local_step > persistent
    for name in os.listdir(tmp_path / "local" / "1"):  # a replaced machine: its disk is empty
        subprocess.run(["rm", "-rf", str(tmp_path / "local" / "1" / name)], check=True)

    procs, logs = launch([*base, f"--workdir={workdir}"], tmp_path / "relaunched-logs")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], text(logs[0])[-2000:] + text(logs[1])[-2000:]
    said = text(logs[0])
    if peers:
        assert re.search(rf"resuming from the local checkpoint at step {local_step} in .*local/0/run-\w+, the "
                         r"processes without it \(\[1\]\) given their share", said), said[-2000:]  # fmt: skip
    else:
        assert (f"the local checkpoint at step {local_step} is missing on process 1, and no other process holds a "
                f"replica of its share") in said, said[-2000:]  # fmt: skip
        assert f"resumed from the checkpoint at step {persistent}" in said, said[-2000:]
    assert_equal(final_params(workdir, cfg), final_params(tmp_path / "straight", cfg))


def test_a_rollback_moves_the_local_steps_past_it_out_of_the_way(tmp_path):
    """Local steps saved in a stretch a rollback abandons are moved to <local_dir>/rolled_back/, as the
    workdir's are: a relaunch never resumes the abandoned trajectory from them."""
    from trainer.run.loop import train

    local = tmp_path / "local"
    cfg = micro_config(train=dict(steps=24, log_every=1),
                       checkpoint={"every_steps": 5, "keep": 10, "local_dir": str(local), "local_every_steps": 2},
                       stability=dict(max_bad_steps=4, bad_window=10, stats_warmup=5, diverge_steps=5))  # fmt: skip
    cfg.debug.poison_batches = (12, 13, 14, 15, 16, 17)
    train(cfg, str(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        (event,) = [r for r in map(json.loads, f) if r.get("event") == "rollback"]
    abandoned = sorted(int(n) for n in os.listdir(folder(local) / "rolled_back"))
    assert abandoned and all(s > event["to_step"] for s in abandoned), (abandoned, event)
    assert committed(local) and all(s % 2 == 0 and s % 5 != 0 for s in committed(local))


def test_a_local_save_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, capsys):
    """The write fails for real (a file stands where the step's folder must be made): one warning, the run
    ends as it would have, and the other local steps are written."""
    from trainer.run.loop import train
    from trainer.storage.local_tier import directory_of

    local, workdir = tmp_path / "local", str(tmp_path / "run")
    cfg = micro_config(train=dict(steps=8, log_every=4),
                       checkpoint={"every_steps": 50, "local_dir": str(local), "local_every_steps": 2})  # fmt: skip
    run = "ab" * 16  # the run's identity given beforehand, so that its local folder is known
    wd.write_run_id(workdir, run)
    folder = directory_of(str(local), workdir, run)
    os.makedirs(folder)
    open(os.path.join(folder, "4.partial"), "w").close()
    result = train(cfg, workdir)
    out = capsys.readouterr().out
    assert out.count("warning: writing the local checkpoint tier in") == 1, out
    assert result["step"] == 8 and committed(local) == [2, 6]


def test_a_new_run_in_a_workdir_made_again_never_takes_the_deleted_runs_local_steps(tmp_path, capsys):
    """A local step belongs to the run that wrote it. The workdir deleted and made again (or never there) is a
    new run: it starts afresh (or from checkpoint.init_from), whatever the local tier holds from before."""
    import shutil

    from trainer.run.loop import train

    local, workdir = tmp_path / "local", str(tmp_path / "run")
    settings = {"every_steps": 50, "local_dir": str(local), "local_every_steps": 2}
    cfg = micro_config(train=dict(steps=4, log_every=2), checkpoint=settings)
    train(cfg, workdir)
    assert any((p / "2").is_dir() for p in local.iterdir()), list(local.iterdir())
    shutil.rmtree(workdir)
    capsys.readouterr()

    changed = micro_config(train=dict(steps=4, log_every=2), checkpoint=settings, optim=dict(lr=1e-4))
    train(changed, workdir)
    out = capsys.readouterr().out
    assert "resuming from the local checkpoint" not in out, out
    alone = micro_config(train=dict(steps=4, log_every=2), optim=dict(lr=1e-4))
    train(alone, str(tmp_path / "alone"))
    assert_equal(params_at(workdir, changed, 4), params_at(tmp_path / "alone", alone, 4))

    shutil.rmtree(workdir)  # again, now starting from another run's weights: init_from is not overridden either
    capsys.readouterr()
    train(micro_config(train=dict(steps=4, log_every=2), checkpoint={**settings, "init_from": str(tmp_path / "alone")},
                       optim=dict(lr=1e-4)), workdir)  # fmt: skip
    out = capsys.readouterr().out
    assert "resuming from the local checkpoint" not in out and "started from the weights of" in out, out


def test_a_local_step_whose_config_does_not_fit_is_refused_in_one_sentence(tmp_path):
    """The same run relaunched with another model, its persistent checkpoints gone: the local step's recorded
    config is checked as a persistent resume's is, before anything is read."""
    import shutil

    from trainer.config.errors import ConfigError
    from trainer.run.loop import train

    local, workdir = tmp_path / "local", str(tmp_path / "run")
    settings = {"every_steps": 50, "local_dir": str(local), "local_every_steps": 2}
    train(micro_config(train=dict(steps=4, log_every=2), checkpoint=settings), workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    wider = micro_config(train=dict(steps=6, log_every=2), checkpoint=settings, model=dict(d_ff=192))
    with pytest.raises(ConfigError, match=r"model.d_ff=128 there, 192 here"):
        train(wider, workdir)


def params_at(workdir, cfg, step):
    setup = build(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    params = jax.device_get(ckpt.restore_params(step, abstract_params(setup.model, setup.shard)))
    ckpt.close()
    return params
