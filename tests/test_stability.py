"""Spike and NaN defence, driven by drills through the real training loop."""

import json
import math
import os

import pytest
from conftest import micro_config

from trainer import report
from trainer.errors import ConfigError, TrainingError
from trainer.training.loop import train


def config(corpus_dir, **debug):
    cfg = micro_config(
        data=dict(source="text_files", data_dir=corpus_dir),
        train=dict(steps=30, log_every=1),
        optim=dict(lr=1e-2, warmup_steps=2),
        checkpoint={"every_steps": 5, "keep": 10},
        stability=dict(max_bad_steps=4, bad_window=10, stats_warmup=5, diverge_steps=5),
    )
    cfg.debug.update(debug)
    return cfg


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_an_isolated_poisoned_batch_is_skipped(tmp_path, corpus_dir):
    workdir = str(tmp_path / "run")
    result = train(config(corpus_dir, poison_batches=(7,)), workdir)
    steps = {r["step"]: r for r in records(workdir) if "loss" in r}
    # Batch 7 is read by step 8: skipped, parameters as they were after step 7.
    assert steps[8]["skipped"] == 1 and steps[8]["nonfinite"] == 1
    assert steps[8]["param_norm"] == steps[7]["param_norm"]
    assert [r["event"] for r in records(workdir) if "event" in r] == ["skipped"]
    # One step trained on nothing, so 30 batches take 31 steps.
    assert result["step"] == 31 and math.isfinite(result["loss"])


def test_a_poisoned_window_longer_than_the_budget_rolls_back_and_the_run_finishes(tmp_path, corpus_dir):
    workdir = str(tmp_path / "run")
    result = train(config(corpus_dir, poison_batches=(12, 13, 14, 15, 16, 17)), workdir)
    events = [r for r in records(workdir) if r.get("event") == "rollback"]
    assert len(events) == 1
    rollback = events[0]
    assert rollback["reason"] == "4 bad steps in the last 10"
    # Back to the newest checkpoint with a clean window (step 10: batch 12 is read by step 13),
    # the batches read since skipped (steps 11-16 and step 17, already dispatched when step 16's
    # metrics were read), the learning rate halved.
    assert rollback["to_step"] == 10 and rollback["lr_scale"] == 0.5 and rollback["data_batches_skipped"] == 7
    assert (tmp_path / "run" / "rolled_back_checkpoints" / "15").is_dir()
    assert math.isfinite(result["loss"]) and result["loss"] < 4.0

    # scripts/report.py's picture of it: the logged losses in order (the abandoned stretch included), the
    # rollback on every panel, the skipped steps crossed.
    fig = report.figure([workdir])
    logged = [r for r in records(workdir) if r.get("loss") is not None]  # non-finite losses are logged as null
    loss_line = fig.axes[0].lines[0]
    assert list(loss_line.get_xdata()) == [r["step"] for r in logged]
    assert list(loss_line.get_ydata()) == [r["loss"] for r in logged]
    for ax in fig.axes:
        assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [rollback["from_step"]]
    crosses = next(line for line in fig.axes[0].lines if line.get_label() == "skipped steps")
    skipped = [r["step"] for r in records(workdir) if r.get("event") == "skipped"]
    assert skipped and list(crosses.get_xdata()) == skipped
    assert os.path.getsize(report.write([workdir, workdir], str(tmp_path / "report.png"))) > 20_000


def test_a_stretch_of_far_too_high_learning_rate_is_survived(tmp_path, corpus_dir):
    workdir = str(tmp_path / "run")
    result = train(config(corpus_dir, lr_spike=(20, 27, 1000)), workdir)
    logged = records(workdir)
    assert max(r["loss"] for r in logged if "loss" in r) > 50  # it really blew up
    assert any(r.get("event") == "rollback" for r in logged)
    assert math.isfinite(result["loss"]) and result["loss"] < 4.0


def test_a_run_that_keeps_diverging_stops_with_a_clear_message(tmp_path, corpus_dir):
    cfg = config(corpus_dir, poison_batches=tuple(range(8, 200)))
    cfg.stability.max_rollbacks = 1
    with pytest.raises(TrainingError, match="needed 2 rollbacks"):
        train(cfg, str(tmp_path / "run"))


def test_drills_that_do_not_parse_are_refused(tmp_path, corpus_dir):
    with pytest.raises(
        ConfigError, match=r"must be \(first batch, last batch, factor\), e.g. --config.debug.lr_spike=20,27,1000"
    ):
        train(config(corpus_dir, lr_spike=("20:27:1000",)), str(tmp_path / "run"))
