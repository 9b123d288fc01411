"""Real multi-process runs: 2 processes x 4 CPU devices against 1 process x 8, through the launcher."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import cli_args, micro_config

from trainer.storage.checkpoint import Checkpointer
from trainer.training.loop import train
from trainer.training.setup import build
from trainer.training.state import abstract_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_config(corpus_dir, steps=10):
    return micro_config(
        data=dict(source="text_files", data_dir=corpus_dir),
        train=dict(steps=steps, log_every=1, eval_every=5),
        optim=dict(schedule="constant"),
    )


def losses(workdir):
    merged = {}  # a step can have a training record and an evaluation record
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            merged.setdefault(record["step"], {}).update(record)
    return merged


def params(cfg, workdir, step):
    setup = build(cfg)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    out = jax.device_get(ckpt.restore_params(step, abstract_params(setup.model, setup.shard)))
    ckpt.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_dir):
    root = tmp_path_factory.mktemp("multiprocess")
    single, multi = str(root / "single"), str(root / "multi")
    args = cli_args(run_config(corpus_dir))
    one = subprocess.run([sys.executable, "scripts/train.py", *args, f"--workdir={single}"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "-n", "2", "--devices_per_process", "4", "--",
         sys.executable, "scripts/train.py", *args, f"--workdir={multi}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert two.returncode == 0, two.stdout[-3000:]
    return single, multi, two.stdout


def test_two_processes_train_exactly_like_one(runs, corpus_dir):
    single, multi, output = runs
    a, b = losses(single), losses(multi)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in a:
        for key in ("loss", "grad_norm", "eval_loss", "unigram_loss"):
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
    cfg = run_config(corpus_dir)
    for x, y in zip(jax.tree.leaves(params(cfg, single, 10)), jax.tree.leaves(params(cfg, multi, 10)), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
    # Only process 0 logs; both took part.
    assert "[0] step     10 (10/10)" in output and "[1] step" not in output


def test_a_two_process_checkpoint_resumes_in_one_process(runs, corpus_dir):
    single, multi, _ = runs
    train(run_config(corpus_dir, steps=12), single)
    result = train(run_config(corpus_dir, steps=12), multi)  # 1 process x 8 devices, data state merged
    assert result["step"] == 12
    a, b = losses(single), losses(multi)
    for step in (11, 12):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4)


def test_a_batch_that_does_not_divide_fails_every_process_with_one_sentence(tmp_path, corpus_dir):
    cfg = run_config(corpus_dir)
    cfg.train.global_batch_size = 12
    result = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "-n", "2", "--devices_per_process", "4", "--",
         sys.executable, "scripts/train.py", *cli_args(cfg), f"--workdir={tmp_path / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode != 0
    assert "[0] error: each microbatch of 12 sequences" in result.stdout
    assert "Traceback" not in result.stdout


def test_a_failing_process_fails_the_launch(tmp_path):
    script = tmp_path / "fail_one.py"
    script.write_text(
        "import os, sys, time\nif os.environ['TRAINER_PROCESS_ID'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
    )
    result = subprocess.run([sys.executable, "scripts/launch_local.py", "-n", "2", "--", sys.executable, str(script)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 3
