"""The training loop end to end: workdir contents, resume, checkpoints, learning."""

import glob
import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import micro_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from trainer import config
from trainer.errors import ConfigError
from trainer.storage.checkpoint import Checkpointer
from trainer.storage.metrics import MetricsWriter
from trainer.storage.workdir import GrowingFiles
from trainer.training.loop import train
from trainer.training.setup import build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGGED = {"step", "loss", "lr", "grad_norm", "param_norm", "tokens_per_sec", "mfu", "step_time"}


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def text_config(corpus_dir, **sections):
    sections.setdefault("data", {})
    sections["data"] = dict(source="text_files", data_dir=corpus_dir, **sections["data"])
    return micro_config(**sections)


def restore_params(cfg, workdir, step):
    setup = build(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=10, async_save=False)
    params = ckpt.restore_params(step, setup.abstract_state().params)
    ckpt.close()
    return jax.device_get(params)


def test_a_run_leaves_config_metrics_tensorboard_and_checkpoints(tmp_path, corpus_dir, capsys):
    cfg = text_config(corpus_dir, train=dict(steps=10, log_every=2, eval_every=5), checkpoint={"every_steps": 5})
    workdir = str(tmp_path / "run")
    result = train(cfg, workdir)
    assert result["step"] == 10
    # The console line's ETA: the batches left times that line's step time.
    etas = re.findall(r"step +(\d+) \(\d+/10\).* eta (\d+)m(\d+)s", capsys.readouterr().out)
    step_times = {r["step"]: r["step_time"] for r in records(workdir) if "loss" in r}
    assert [int(s) for s, _, _ in etas] == [2, 4, 6, 8, 10]
    for step, minutes, seconds in etas:
        assert 60 * int(minutes) + int(seconds) == round((10 - int(step)) * step_times[int(step)])

    with open(os.path.join(workdir, "config.json")) as f:
        assert config.from_dict(json.load(f)).to_dict() == cfg.to_dict()
    logged = records(workdir)
    train_records = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6, 8, 10]
    assert all(LOGGED <= set(r) for r in train_records)
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in train_records)
    evals = [r for r in logged if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert all(r["eval_loss"] > 0 and r["unigram_loss"] > 0 for r in evals)

    events = EventAccumulator(workdir)
    events.Reload()
    loss = events.Tensors("loss")  # tensorboard.summary.Writer writes scalars as tensors
    assert [e.step for e in loss] == [2, 4, 6, 8, 10]
    assert float(tensor_util.make_ndarray(loss[-1].tensor_proto)) == pytest.approx(train_records[-1]["loss"], rel=1e-6)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]


def test_stopping_and_rerunning_continues_the_same_run_bit_for_bit(tmp_path, corpus_dir):
    """8 steps in one go == 4 steps, stop, the same command to 8: same data, same losses, same weights,
    exactly; in fp16, so that the dynamic loss scale (growing every 2 good steps) is restored too."""
    # A constant schedule, so that train.steps=4 and =8 schedule the same rates.
    sections = dict(
        optim=dict(schedule="constant", warmup_steps=2),
        checkpoint={"every_steps": 4},
        precision=dict(compute_dtype="float16", initial_loss_scale=64.0, loss_scale_growth_interval=2),
    )
    straight = str(tmp_path / "straight")
    train(text_config(corpus_dir, train=dict(steps=8, log_every=1), **sections), straight)
    resumed = str(tmp_path / "resumed")
    train(text_config(corpus_dir, train=dict(steps=4, log_every=1), **sections), resumed)
    result = train(text_config(corpus_dir, train=dict(steps=8, log_every=1), **sections), resumed)
    assert result["step"] == 8

    a, b = records(straight), records(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))  # the step count went on from 4
    for ra, rb in zip(a, b, strict=True):
        assert (rb["loss"], rb["grad_norm"], rb["lr"], rb["loss_scale"]) == (
            ra["loss"], ra["grad_norm"], ra["lr"], ra["loss_scale"]
        )  # fmt: skip
    cfg = text_config(corpus_dir, train=dict(steps=8), **sections)
    for pa, pb in zip(
        jax.tree.leaves(restore_params(cfg, straight, 8)), jax.tree.leaves(restore_params(cfg, resumed, 8)), strict=True
    ):
        np.testing.assert_array_equal(pa, pb)


def test_a_finished_run_rerun_does_nothing(tmp_path):
    cfg = micro_config(train=dict(steps=4))
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    before = records(workdir)
    assert train(cfg, workdir) == {"step": 4}
    assert records(workdir) == before


def test_records_logged_after_the_restored_checkpoint_are_dropped(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (2, 4, 6):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
    MetricsWriter(GrowingFiles(str(tmp_path)), resume_step=4).close()
    assert [r["step"] for r in records(tmp_path)] == [2, 4]


def test_profile_steps_writes_a_trace_of_those_steps(tmp_path, capsys):
    cfg = micro_config(train=dict(steps=4, profile_steps=(2, 3)))
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    traces = glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"), recursive=True)
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    assert "profile of steps 2-3 written to" in capsys.readouterr().out


def test_a_malformed_profile_window_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"train.profile_steps=\(3, 2\) must be \(first, last\)"):
        train(micro_config(train=dict(profile_steps=(3, 2))), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
