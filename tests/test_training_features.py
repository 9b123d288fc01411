"""Batch-size ramp and diagnostic metrics, through the real training loop."""

import json
import math
import os

import pytest
from conftest import data_state, micro_config

from trainer.config.errors import ConfigError
from trainer.optim.schedules import make_schedule
from trainer.run.loop import train


def records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "loss" in json.loads(line)]


def test_a_batch_ramp_grows_the_batch_and_keeps_the_schedule_in_tokens(tmp_path):
    # Microbatch 8 sequences; the full batch is 4 of them. The ramp starts at 1 and reaches 4
    # after 6 microbatches' worth of tokens.
    cfg = micro_config(
        train=dict(steps=6, global_batch_size=32, grad_accum_steps=4, log_every=1, ramp_batch_size=8,
                   ramp_tokens=6 * 8 * 32),
        optim=dict(warmup_steps=1, schedule="linear"),
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    result = train(cfg, workdir)
    logged = records(workdir)
    sizes = [round(r["target_tokens"] / (8 * 31)) for r in logged]  # microbatches per step (31 targets a row)
    # 1, then 2, then 4 microbatches a step (measured: 1 1 2 2 4 4 4 4 2); the last step takes only
    # what is left, so that exactly 6 full batches' worth of data is trained on ...
    assert sizes[0] == 1 and sizes[:-1] == sorted(sizes[:-1]) and 2 in sizes and max(sizes) == 4
    assert sum(sizes) == 6 * 4
    assert result["step"] == len(logged) > 6  # ... in more than 6 steps
    schedule = make_schedule(cfg.optim, cfg.train.steps)
    trained = 0
    for r, k in zip(logged, sizes, strict=True):
        assert r["lr"] == pytest.approx(float(schedule(trained / 4)), rel=1e-6)  # the schedule counts full batches
        trained += k


def test_a_ramp_that_does_not_fit_the_microbatch_is_refused(tmp_path):
    cfg = micro_config(train=dict(global_batch_size=32, grad_accum_steps=4, ramp_batch_size=12, ramp_tokens=1000))
    with pytest.raises(ConfigError, match="ramp_batch_size=12 must be a multiple of the microbatch .8 sequences"):
        train(cfg, str(tmp_path / "run"))


def test_diagnostic_metrics_are_logged_and_add_up(tmp_path):
    cfg = micro_config(train=dict(steps=3, log_every=1, layer_grad_norms=True), optim=dict(z_loss=1e-4))
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    last = records(workdir)[-1]
    for key in ("grad_norm", "param_norm", "update_ratio", "max_logit", "skipped", "skipped_total", "loss_scale"):
        assert key in last and math.isfinite(last[key]), key
    assert 0 < last["update_ratio"] < 1 and last["max_logit"] > 0 and last["loss_scale"] == 1.0
    per_layer = {k: v for k, v in last.items() if k.startswith("grad_norm/layers.")}
    # Nine stacked weights, one norm per layer each (their values: tests/test_step.py).
    assert len(per_layer) == 9 * cfg.model.n_layers


def test_an_unknown_precision_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="precision.compute_dtype='fp8' is not one of float32, bfloat16, float16"):
        train(micro_config(precision=dict(compute_dtype="fp8")), str(tmp_path / "run"))


def test_another_global_batch_on_resume_reads_what_a_straight_run_reads_and_keeps_the_schedule(
    tmp_path, corpus_dir, capsys
):
    """16 a step for 2 steps, then 32 for 1 step, then 8 for 2 steps: the run's 16 document streams are each read
    to the very place a straight run of 5 steps of 16 reads them to (so no window is read twice or skipped), and
    the learning rate follows the schedule in tokens. A batch that cannot read the streams evenly, and one that
    does not divide what is left to read, are one sentence each, with the workdir left as it was."""
    from trainer.config.forms import with_changes

    data = dict(source="text_files", data_dir=corpus_dir)
    cfg = micro_config(data=data, train=dict(steps=5, global_batch_size=16, log_every=1),
                       checkpoint={"every_steps": 1, "keep": 10})  # fmt: skip
    straight, changed = str(tmp_path / "straight"), str(tmp_path / "changed")
    train(cfg, straight)
    train(with_changes(cfg, {"train.steps": 2}), changed)
    config_before = open(os.path.join(changed, "config.json")).read()
    for changes, said in [
        ({"train.global_batch_size": 24}, r"train.global_batch_size=24 cannot read this run's 16 document streams "
                                          r"\(data.stream_rows\) evenly: it must divide 16 or be a multiple of it"),
        ({"train.global_batch_size": 32, "train.steps": 5}, r"has 48 sequences left to read \(train.steps=5 batches "
                                                            r"of 16\), which train.global_batch_size=32 does not "
                                                            r"divide; .* e.g. 6\."),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            train(with_changes(cfg, changes), changed)
        assert open(os.path.join(changed, "config.json")).read() == config_before
    train(with_changes(cfg, {"train.global_batch_size": 32, "train.steps": 4}), changed)
    train(with_changes(cfg, {"train.global_batch_size": 8}), changed)
    out = capsys.readouterr().out
    assert "train.global_batch_size: 16 there, 32 here: the data keeps the run's 16 document streams" in out
    assert "train.global_batch_size: 32 there, 8 here: the data keeps the run's 16 document streams" in out

    assert data_state(changed, 5) == data_state(straight, 5)
    assert data_state(changed, 3) == data_state(straight, 4)
    halfway = data_state(changed, 4)  # a step of 8 reads every other stream: half of them one window further
    ahead = [r for r in halfway if halfway[r] != data_state(straight, 4)[r]]
    assert ahead == [str(r) for r in range(0, 16, 2)] and all(halfway[r] == data_state(straight, 5)[r] for r in ahead)
    logged = records(changed)
    assert [r["sequences"] for r in logged] == [16, 32, 64, 72, 80]
    schedule = make_schedule(cfg.optim, cfg.train.steps)
    for r, before in zip(logged[3:], (64, 72), strict=True):  # the last launch's steps, on the straight schedule
        assert r["lr"] == pytest.approx(float(schedule(before / 16)), rel=1e-6)
