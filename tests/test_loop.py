"""The training loop end to end: workdir contents, resume, checkpoints, learning."""

import glob
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import micro_config
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from trainer.config import forms
from trainer.config.errors import ConfigError
from trainer.run import startup
from trainer.run.loop import train
from trainer.storage.checkpoint import Checkpointer
from trainer.storage.metrics import MetricsWriter
from trainer.storage.workdir import GrowingFiles
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
        assert forms.from_dict(json.load(f)).to_dict() == cfg.to_dict()
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
    loss = events.Tensors("loss")  # scalars read as TensorBoard reads them: as tensors
    assert [e.step for e in loss] == [2, 4, 6, 8, 10]
    assert float(tensor_util.make_ndarray(loss[-1].tensor_proto)) == pytest.approx(train_records[-1]["loss"], rel=1e-6)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "5"]


def test_stopping_and_rerunning_continues_the_same_run_bit_for_bit(tmp_path, corpus_dir):
    """8 steps in one go == 4 steps, stop, the same command to 8 (reading its data in worker processes):
    same data, same losses, same weights, exactly; in fp16, so that the dynamic loss scale (growing every
    2 good steps) is restored too."""
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
    # The second half reads its rows in two worker processes (data.workers), from the checkpoint's state.
    result = train(text_config(corpus_dir, train=dict(steps=8, log_every=1), data=dict(workers=2), **sections), resumed)
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
    files = {p: open(p, "rb").read() for p in glob.glob(f"{workdir}/**", recursive=True) if os.path.isfile(p)}
    assert train(cfg, workdir) == {"step": 4}
    assert records(workdir) == before
    # Not a launch of the run: its time account (goodput.json) and every other file as they were.
    after = {p: open(p, "rb").read() for p in glob.glob(f"{workdir}/**", recursive=True) if os.path.isfile(p)}
    assert after.keys() == files.keys() and [p for p in files if after[p] != files[p]] == []


def test_records_logged_after_the_restored_checkpoint_are_moved_aside_not_dropped(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in (2, 4, 6, 8):
            f.write(json.dumps({"step": step, "loss": float(step)}) + "\n")
        f.write('{"step": 10, "lo')  # cut short by a kill
    MetricsWriter(GrowingFiles(str(tmp_path)), resume_step=4).close()
    assert [r["step"] for r in records(tmp_path)] == [2, 4]
    with open(tmp_path / "metrics.superseded.jsonl") as f:
        assert f.read().splitlines() == ['{"step": 6, "loss": 6.0}', '{"step": 8, "loss": 8.0}', '{"step": 10, "lo']
    MetricsWriter(GrowingFiles(str(tmp_path)), resume_step=0).close()  # a later fresh start: appended
    assert records(tmp_path) == []
    with open(tmp_path / "metrics.superseded.jsonl") as f:
        assert [json.loads(line)["step"] for line in f.read().splitlines()[3:]] == [2, 4]


def test_a_fresh_start_over_an_earlier_runs_history_is_refused_and_a_short_one_kept_aside(tmp_path):
    """No checkpoint, but records at step 2 x checkpoint.every_steps or later: a checkpoint was surely there
    (moved or deleted), and starting afresh would bury its history; a shorter history is a run stopped before
    its first save, moved to the side file as the new run starts."""
    cfg = micro_config(train=dict(steps=4, log_every=1), checkpoint={"every_steps": 5})
    workdir = tmp_path / "run"
    workdir.mkdir()
    history = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 11))
    (workdir / "metrics.jsonl").write_text(history)
    with pytest.raises(ConfigError, match=r"holds an earlier run's history \(10 records up to step 10 in metrics"):
        train(cfg, str(workdir))
    assert (workdir / "metrics.jsonl").read_text() == history and sorted(os.listdir(workdir)) == ["metrics.jsonl"]

    (workdir / "metrics.jsonl").write_text(history[: history.index('{"step": 9')])  # steps 1..8 < 10
    train(cfg, str(workdir))
    assert [r["step"] for r in records(workdir) if "loss" in r] == [1, 2, 3, 4]
    assert (workdir / "metrics.superseded.jsonl").read_text() == history[: history.index('{"step": 9')]


def test_weights_and_biases_runs_belong_to_their_workdir(tmp_path, monkeypatch):
    """The W&B id lives in the workdir: a resume continues its run, a fresh start in the same path and
    another workdir each get their own; the run is named by the resolved path."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro_config(train=dict(trackers=("wandb",)))

    def run_id(workdir, fresh):
        writer = MetricsWriter(GrowingFiles(str(workdir)), cfg=cfg, workdir=str(workdir), fresh=fresh)
        ident, name = writer._trackers[0]._run.id, writer._trackers[0]._run.name
        writer.close()
        return ident, name

    monkeypatch.chdir(tmp_path)
    first, name = run_id("runs/x", fresh=True)
    assert name == str(tmp_path / "runs" / "x")
    assert run_id(tmp_path / "runs" / "x", fresh=False)[0] == first  # the same workdir, spelt otherwise
    assert run_id("runs/y", fresh=True)[0] != first
    assert run_id("runs/x", fresh=True)[0] != first  # a new run in a reused path


def test_profile_steps_writes_a_trace_of_those_steps(tmp_path, capsys):
    cfg = micro_config(train=dict(steps=4, profile_steps=(2, 3)))
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    traces = glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"), recursive=True)
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    assert "profile of steps 2-3 written to" in capsys.readouterr().out


def test_a_resume_restores_into_the_abstract_state_and_compiles_no_initialiser(tmp_path, caplog):
    """A fresh run compiles the state's initialiser (`init`: the parameters' random draws and the optimiser's
    zeros) beside its train step; a resume restores the checkpoint into the abstract sharded state and
    compiles the train step alone: nothing it is about to overwrite is built. JAX's own compile log says
    which programs compiled."""
    workdir = str(tmp_path / "run")

    def compiled(steps: int) -> set[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
            train(micro_config(train=dict(steps=steps)), workdir)
        return set(re.findall(r"Finished XLA compilation of jit\((\w+)\)", caplog.text))

    assert {"init", "train_step"} <= compiled(2)
    assert compiled(3) == {"train_step"}


def test_a_malformed_profile_window_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"train.profile_steps=\(3, 2\) must be \(first, last\)"):
        train(micro_config(train=dict(profile_steps=(3, 2))), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


# What the quick start may import before its first step: the count measured (2,124 at 7b2c1e0 with every extra
# installed) and a little room, so that a new import of a large library is seen here, not in a launch's seconds.
IMPORT_BUDGET = 2200
# Installed by the extras for other paths; a run that does not ask for them must not pay for them (torch alone was
# 2.0 s of every launch, tensorboardX's bucket clients 1.6 s).
NOT_IMPORTED = ("torch", "transformers", "tensorflow", "peft", "trl", "lm_eval", "wandb", "apache_beam", "megatron",
                "boto3", "google.cloud.storage", "matplotlib")  # fmt: skip
IMPORTS_AT_FIRST_STEP = """
import json, runpy, sys
from trainer.run import startup
out, mark = sys.argv.pop(1), startup.mark
def seen(part, note=""):
    mark(part, note)
    if part == "first step":
        with open(out, "w") as f:
            json.dump(sorted(sys.modules), f)
startup.mark = seen
sys.argv[0] = "scripts/train.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_quick_start_imports_within_its_budget_and_says_where_its_start_up_went(tmp_path):
    """The quick start in a fresh interpreter, as a launch is: the modules loaded when its first step has run
    stay within IMPORT_BUDGET and hold none of NOT_IMPORTED (TensorBoard's writer is imported without torch and
    the bucket clients: trainer/storage/trackers.py), and the launch's `start-up:` line gives every part of it,
    in order, adding up to the line's total."""
    modules = tmp_path / "modules.json"
    out = subprocess.run([sys.executable, "-c", IMPORTS_AT_FIRST_STEP, str(modules), "--config",
                          "configs/quickstart.py", "--config.train.steps=1", "--config.optim.warmup_steps=0",
                          "--config.train.eval_every=0",  # the modules are counted at the first step: no eval after
                          f"--config.data.data_dir={tmp_path / 'data'}", f"--workdir={tmp_path / 'run'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(modules.read_text())
    assert "tensorboardX" in loaded and len(loaded) <= IMPORT_BUDGET, len(loaded)
    assert not [m for m in loaded if m in NOT_IMPORTED or m.startswith(tuple(f"{n}." for n in NOT_IMPORTED))]
    assert glob.glob(str(tmp_path / "run" / "events.out.tfevents.*"))
    said = [line for line in out.stdout.splitlines() if line.startswith("start-up: ")]
    assert len(said) == 1, out.stdout[-2000:]
    parts = startup.parse(said[0])
    assert list(parts) == list(startup.PARTS) and all(v >= 0 for v in parts.values()), said
    total = float(said[0].split()[1].removesuffix("s"))
    assert total == pytest.approx(sum(parts.values()), abs=0.06) and "(initialised)" in said[0], said


def test_trackers_get_metrics_events_and_samples_and_samples_are_the_models_greedy_text(
    tmp_path, corpus_dir, monkeypatch, capsys
):
    """TensorBoard and W&B (offline: no network) get the config, every record, a skipped-step event and
    the samples; the logged greedy completion equals decoding the final weights without a KV cache."""
    from test_generate import naive_generate

    from trainer.data.tokenizers import load_tokenizer
    from trainer.evaluation.samples import completion, prompt_ids

    has_wandb = importlib.util.find_spec("wandb") is not None  # the wandb extra; CI installs it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    prompts = ("def ", "import")
    cfg = text_config(
        corpus_dir,
        train=dict(steps=4, log_every=1, eval_every=2, trackers=("tensorboard", "wandb")[: 1 + has_wandb],
                   sample_prompts=prompts, sample_tokens=8),
        debug=dict(poison_batches=(1,)),  # data batch 1 (numbered from 0), so step 2, is skipped: an event
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    assert train(cfg, workdir)["step"] == 5  # 4 batches trained on, one step skipped
    logged = records(workdir)
    samples = [r for r in logged if "samples" in r]
    assert [r["step"] for r in samples] == [2, 4, 5]
    assert all([row["prompt"] for row in r["samples"]] == list(prompts) for r in samples)
    out = capsys.readouterr().out
    assert f"step      5  sample (greedy): {prompts[0] + samples[-1]['samples'][0]['greedy']!r}" in out

    setup = build(cfg)
    params = restore_params(cfg, workdir, 5)
    tokenizer = load_tokenizer(cfg.data)
    for row in samples[-1]["samples"]:
        ids = naive_generate(setup, params, prompt_ids(tokenizer, row["prompt"])[None], 8)[0]
        assert row["greedy"] == completion(tokenizer, ids)
        assert row["sampled"] != row["greedy"] or len(row["greedy"]) == 0  # temperature 0.8 over 8 tokens

    events = EventAccumulator(workdir)
    events.Reload()
    train_records = [r for r in logged if "loss" in r and r["loss"] is not None]
    tb_loss = {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors("loss")}
    assert tb_loss == pytest.approx({r["step"]: r["loss"] for r in train_records}, rel=1e-6)
    assert [e.step for e in events.Tensors("events/skipped")] == [2]
    assert [e.step for e in events.Tensors("eval_loss")] == [2, 4, 5]
    text = lambda tag: [tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in events.Tensors(tag)]
    assert '"compute_dtype": "float32"' in text("config/text_summary")[0]
    assert samples[-1]["samples"][1]["greedy"] in text("samples/text_summary")[-1]

    if not has_wandb:
        pytest.skip('wandb is not installed (pip install -e ".[wandb]"): TensorBoard and samples checked, W&B not')
    run_dir = glob.glob(os.path.join(workdir, "wandb", "offline-run-*"))
    assert len(run_dir) == 1
    history, config_keys = wandb_offline_log(glob.glob(os.path.join(run_dir[0], "run-*.wandb"))[0])
    assert "train.trackers" in config_keys
    wb_loss = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert wb_loss == pytest.approx({r["step"]: r["loss"] for r in train_records}, rel=1e-6)
    assert [h["step"] for h in history if "events/skipped" in h] == [2]
    assert [h["step"] for h in history if "eval_loss" in h] == [2, 4, 5]
    tables = [(h["step"], h["samples/path"]) for h in history if "samples/path" in h]
    assert [step for step, _ in tables] == [2, 4, 5]
    with open(os.path.join(run_dir[0], "files", tables[-1][1])) as f:
        assert json.load(f)["data"] == [[r["prompt"], r["greedy"], r["sampled"]] for r in samples[-1]["samples"]]


def wandb_offline_log(path):
    """(history records, config keys) of an offline W&B run, read from its transaction log: a 7-byte
    header, then LevelDB's log format (32 KiB blocks; chunks with a 7-byte header, type 1 = whole
    record, 2-4 = first/middle/last piece) holding W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    history, config_keys = [], set()
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.HasField("history"):
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        config = record.config if record.HasField("config") else record.run.config if record.HasField("run") else None
        if config is not None:
            config_keys |= {i.key for i in config.update}
    return history, config_keys


def test_the_clock_steps_past_two_to_the_31_sequences(tmp_path):
    """A run resumed just below 2^31 sequences (int32's limit) steps past it: the learning rate is the
    schedule's (constant after warmup: the peak; a wrapped clock reads as warmup, negative), the logged
    sequence counts and the saved data position are exact, and the run finishes when it should."""
    from trainer.training import clock

    batch, start = 8, 2**31 - 8
    steps = start // batch + 3  # the run's end: 16 sequences past 2^31
    cfg = micro_config(optim=dict(schedule="constant", warmup_steps=2), train=dict(steps=steps, log_every=1),
                       checkpoint={"every_steps": 2})  # fmt: skip
    workdir = str(tmp_path / "run")
    setup = build(cfg)
    state = setup.new_state()
    counts = {"sequences": clock.of(start, batch), "data_read": clock.of(start, batch), "batch": np.int32(batch)}
    state = state.replace(step=jax.numpy.int32(start // batch), clock=jax.device_put(counts, state.step.sharding))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=3)
    ckpt.save(start // batch, state, None)
    ckpt.close()

    result = train(cfg, workdir)
    logged = [r for r in records(workdir) if "loss" in r]
    assert [r["sequences"] for r in logged] == [start + 8, start + 16, start + 24]
    assert all(r["lr"] == pytest.approx(cfg.optim.lr, rel=1e-6) for r in logged)
    assert result["step"] == steps
    assert train(cfg, workdir) == {"step": steps}  # finished: nothing more to train
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    meta = ckpt.restore_meta(steps, setup.shard.replicated())
    assert clock.value(meta["clock"]["data_read"], int(meta["clock"]["batch"])) == start + 24 == 2**31 + 16
    ckpt.close()


def test_a_start_up_that_fails_late_leaves_no_thread_or_process_behind(tmp_path, corpus_dir, monkeypatch):
    """W&B, the last thing a start-up opens, refuses: the data workers, the prefetch thread, TensorBoard's
    writer and the checkpoint manager opened before it are all closed, and the refusal is one sentence."""
    import multiprocessing
    import threading

    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # W&B reads its WANDB_* settings once per process, at its first run
    monkeypatch.setenv("WANDB_MODE", "bogus")
    cfg = text_config(corpus_dir, data=dict(workers=2), train=dict(steps=4, trackers=("tensorboard", "wandb")))
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match=r"W&B could not start a run .*or set WANDB_MODE=offline"):
        train(cfg, str(tmp_path / "run"))
    assert multiprocessing.active_children() == []
    left = [t.name for t in set(threading.enumerate()) - before]
    # W&B keeps one event-loop thread per process once imported, as after any finished run of its own.
    assert [name for name in left if name != "wandb-AsyncioManager-main"] == []
