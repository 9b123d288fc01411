"""Spike and NaN defence, driven by drills through the real training loop."""

import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, cli_args, micro_config

from trainer.config.errors import ConfigError, TrainingError
from trainer.evaluation import report
from trainer.run.loop import train
from trainer.storage.goodput import BUCKETS
from trainer.storage.workdir import saved_steps

PAUSE = 2.0  # seconds between a killed launch and the next


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


def test_a_bad_step_computed_again_tells_a_flipped_bit_from_a_bad_batch(tmp_path, corpus_dir, capsys):
    """stability.rerun_bad_steps: one bit flipped once in one gradient (batch 3, read by step 4) gives another
    result when the step is computed again: transient; a poisoned batch (6, read by step 7) gives the same
    twice: persistent. Each verdict is in its skipped-step event, and healthy steps are never computed again."""
    workdir = str(tmp_path / "run")
    cfg = config(corpus_dir, flip_batches=(3,), poison_batches=(6,))
    cfg.train.steps, cfg.stability.rerun_bad_steps = 10, True
    train(cfg, workdir)
    events = [r for r in records(workdir) if r.get("event") == "skipped"]
    assert [(e["step"], e["rerun"]) for e in events] == [(4, {"transient": 1, "persistent": 0}),
                                                         (7, {"transient": 0, "persistent": 1})]  # fmt: skip
    steps = {r["step"]: r for r in records(workdir) if "loss" in r}
    assert steps[4]["nonfinite"] == 1 and steps[4]["param_norm"] == steps[3]["param_norm"]
    assert steps[12]["rerun_transient"] == 1 and steps[12]["rerun_persistent"] == 1  # 10 batches, 2 steps skipped
    assert "computed again: 1 transient, 0 persistent (another result: a hardware fault" in capsys.readouterr().out


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


# 40-50 s in CI, moved to pytest -m slow to keep CI under 25 minutes beside the MoE tests; the other
# rollback drills stay in CI
@pytest.mark.slow
def test_a_poisoned_window_longer_than_the_budget_rolls_back_and_the_run_finishes(tmp_path, corpus_dir, capsys):
    """Launched, killed at step 8 or later (its checkpoint at step 5 behind it), relaunched after a pause, then
    rolled back by the drill: where the wall time went is accounted across both launches (goodput)."""
    workdir = str(tmp_path / "run")
    cfg = config(corpus_dir, poison_batches=(12, 13, 14, 15, 16, 17))
    began = time.time()
    killed = subprocess.Popen([sys.executable, "scripts/train.py", *cli_args(cfg), f"--workdir={workdir}"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    while killed.poll() is None and not (5 in _saved(workdir) and any(r["step"] >= 8 for r in _so_far(workdir))):
        time.sleep(0.01)
    killed.kill()
    first_out = killed.communicate()[0]
    time.sleep(PAUSE)
    result = train(cfg, workdir)
    elapsed = time.time() - began
    events = [r for r in records(workdir) if r.get("event") == "rollback"]
    assert len(events) == 1
    rollback = events[0]
    assert rollback["reason"] == "4 bad steps in the last 10"
    # Back to the newest checkpoint with a clean window (step 10: batch 12 is read by step 13),
    # the batches read since skipped (steps 11-16 and step 17, already dispatched when step 16's
    # metrics were read), the learning rate halved.
    assert rollback["to_step"] == 10 and rollback["lr_scale"] == 0.5 and rollback["data_batches_skipped"] == 7
    assert (tmp_path / "run" / "rolled_back_checkpoints" / "15").is_dir()
    # No save is skipped after the rollback (MaxText's bug of September 2026): step 15 is saved again on the new
    # trajectory, beside the abandoned one set aside, and every later multiple of 5 too.
    assert {15, 20, 25, 30} <= set(saved_steps(workdir))
    assert math.isfinite(result["loss"]) and result["loss"] < 4.0

    # scripts/report.py's picture of it: the logged losses in order (the abandoned stretch included), the
    # rollback on every panel, the skipped steps crossed.
    fig = report.figure([workdir])
    logged = [r for r in records(workdir) if r.get("loss") is not None]  # non-finite losses are logged as null
    loss_line = fig.axes[0].lines[0]
    assert list(loss_line.get_xdata()) == [r["step"] for r in logged]
    assert list(loss_line.get_ydata()) == [r["loss"] for r in logged]
    for ax in fig.axes[: len(report.PANELS)]:
        assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [rollback["from_step"]]
    crosses = next(line for line in fig.axes[0].lines if line.get_label() == "skipped steps")
    skipped = [r["step"] for r in records(workdir) if r.get("event") == "skipped"]
    assert skipped and list(crosses.get_xdata()) == skipped
    assert os.path.getsize(report.write([workdir, workdir], str(tmp_path / "report.png"))) > 20_000

    # Goodput. Each share against the events that made it:
    with open(os.path.join(workdir, "goodput.json")) as f:
        account = json.load(f)
    s = account["seconds"]
    assert account["launches"] == 2
    step_times = [r["step_time"] for r in records(workdir) if "step_time" in r]
    slack = 3 * sorted(step_times)[len(step_times) // 2] + 0.3  # where a step's time begins and ends differs
    # compiles: the seconds each launch printed;
    out = first_out + capsys.readouterr().out
    printed = [float(x) for x in re.findall(r"compiled the train step for \d+ sequences in ([\d.]+)s", out)]
    assert len(printed) == 2 and s["compile"] == pytest.approx(sum(printed), abs=0.05 * len(printed) + 0.01)
    # lost to the restart: the step time the killed launch logged past step 5, where the relaunch resumed
    # (its records are in metrics.superseded.jsonl);
    with open(os.path.join(workdir, "metrics.superseded.jsonl")) as f:
        redone = [r for r in map(json.loads, f) if "step_time" in r]
    assert "resumed from the checkpoint at step 5" in out, out[:3000]
    assert redone and min(r["step"] for r in redone) == 6
    assert s["lost_restart"] == pytest.approx(sum(r["step_time"] for r in redone), abs=slack)
    # lost to the rollback: the step time logged past the checkpoint it went back to, up to the step it left;
    logged = records(workdir)
    before = logged[: logged.index(rollback)]
    undone = [r["step_time"] for r in before if "step_time" in r and rollback["to_step"] < r["step"]]
    assert len(undone) == rollback["from_step"] - rollback["to_step"] - 1  # from_step was dispatched, never logged
    assert s["lost_rollback"] == pytest.approx(sum(undone), abs=slack)
    # between launches: the pause, the killed launch's unlogged last moments and the relaunch's start;
    assert PAUSE <= s["between_launches"] < PAUSE + 10
    # no evaluation was asked for, and saves and the rollback's restore took time;
    assert s["eval"] == 0 and s["checkpoint"] > 0 and s["rollback"] > 0 and s["data"] >= 0
    # and every second is somewhere: the test's wall time, less the first process's start before train().
    assert elapsed - 20 < sum(s.values()) <= elapsed
    # The records' step times (data waits included) add up to the productive time and the waits.
    assert s["step"] + s["data"] == pytest.approx(sum(step_times) - sum(undone), abs=3 * slack)
    # It is printed at the end, in every logged record (so TensorBoard and W&B), and drawn by the report.
    own = sum(s.values()) - s["between_launches"]  # the share is of the launches' own time, the pause apart
    assert re.search(rf"goodput {100 * s['step'] / own:.1f}%: .* of the run's own time over 2 launches \(.*\); "
                     rf"0m\d\ds between launches, not counted", out)  # fmt: skip
    shares = [r["goodput/share"] for r in records(workdir) if "goodput/share" in r]
    assert len(shares) == len(step_times) and all(0 < x < 1 for x in shares)
    bars = fig.axes[-1].patches
    assert [b.get_width() for b in bars] == pytest.approx([s[name] / sum(s.values()) for name in BUCKETS])


def _saved(workdir):
    return saved_steps(workdir) if os.path.isdir(os.path.join(workdir, "checkpoints")) else []


def _so_far(workdir):
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


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


def test_an_unreadable_time_account_is_set_aside_and_the_run_goes_on(tmp_path, capsys):
    """goodput.json cut short (or edited) stops nothing: it is kept beside, and the account starts again."""
    from trainer.storage.goodput import Goodput
    from trainer.storage.workdir import GrowingFiles

    (tmp_path / "goodput.json").write_text('{"seconds": {"step": 1.')
    account = Goodput()
    account.open(GrowingFiles(str(tmp_path)), step=5)
    assert (tmp_path / "goodput.json.unreadable").read_text() == '{"seconds": {"step": 1.'
    assert account.launches == 1 and "could not be read" in capsys.readouterr().out
    with open(tmp_path / "goodput.json") as f:
        assert json.load(f)["at_save"] == {"5": 0.0}


def test_the_printed_goodput_is_the_account_written_last(tmp_path):
    """The summary printed at the end is the account that goodput.json holds, however long the end takes
    (a slow machine once printed 22.3% beside a file that said 22.4%)."""
    from trainer.storage.goodput import Goodput
    from trainer.storage.workdir import GrowingFiles

    account = Goodput()
    account.open(GrowingFiles(str(tmp_path)), step=0)
    account.enter("step")
    time.sleep(0.05)
    account.close()
    time.sleep(0.2)  # what comes after the last write (a teacher's comparison run, the files' upload) is not the run's
    with open(tmp_path / "goodput.json") as f:
        s = json.load(f)["seconds"]
    assert account.seconds == s
    assert f"goodput {100 * s['step'] / (sum(s.values()) - s['between_launches']):.1f}%" in account.summary()
