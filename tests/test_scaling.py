"""The scaling-law lab: fits recover a known law, and a micro sweep runs sweep -> fit -> predict for real."""

import csv
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, micro_config

from trainer.config.errors import ConfigError
from trainer.planning import scaling_lab, scaling_sweep
from trainer.planning.scaling import Law
from trainer.storage import workdir as wd

TRUE = Law(E=1.8, A=300.0, B=2000.0, alpha=0.35, beta=0.4)


def synthetic_points(noise=0.005, seed=1):
    """An isoFLOP grid (4 budgets x 7 sizes around each optimum) of TRUE, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    n, c = [], []
    for flops in (1e16, 1e17, 1e18, 1e19):
        for f in np.geomspace(1 / 6, 6, 7):
            n.append(TRUE.optimum(flops)["n_params"] * f)
            c.append(flops)
    n, c = np.array(n), np.array(c)
    d = c / (6 * n)
    return n, d, c, TRUE.loss(n, d) * np.exp(rng.normal(0, noise, len(n)))


def test_both_approaches_recover_a_known_law_from_noisy_points(tmp_path):
    n, d, c, loss = synthetic_points()
    table = tmp_path / "paper.csv"
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["n_params", "tokens", "loss"])  # no flops column: 6 N D
        writer.writerows(zip(n, d, loss, strict=True))
    result = scaling_lab.fit(str(tmp_path), str(table), resamples=50)

    a3, a2, iv = result["approach3"], result["approach2"], result["intervals"]
    assert a3["alpha"] == pytest.approx(TRUE.alpha, abs=0.02) and a3["beta"] == pytest.approx(TRUE.beta, abs=0.02)
    assert a3["E"] == pytest.approx(TRUE.E, abs=0.05)
    # Under C = 6 N D the optimum grows as N ~ C^(beta/(alpha+beta)), D ~ C^(alpha/(alpha+beta)).
    a_true = TRUE.beta / (TRUE.alpha + TRUE.beta)
    assert a2["a"] == pytest.approx(a_true, abs=0.03) and a2["b"] == pytest.approx(1 - a_true, abs=0.03)
    assert iv["approach3"]["alpha"][0] < TRUE.alpha < iv["approach3"]["alpha"][1]
    assert iv["approach3"]["beta"][0] < TRUE.beta < iv["approach3"]["beta"][1]
    assert iv["approach2"]["a"][0] < a_true < iv["approach2"]["a"][1]
    # Tokens per parameter at each budget's optimum, against the true law's closed form.
    for o in result["optimum_at_budgets"]:
        truth = TRUE.optimum(o["flops"])
        assert o["approach3"]["tokens_per_param"] == pytest.approx(truth["tokens"] / truth["n_params"], rel=0.15)
    for path in result["plots"]:
        assert os.path.getsize(path) > 10_000
    assert json.load(open(tmp_path / "fit.json"))["approach3"]["alpha"] == a3["alpha"]


def test_a_points_table_without_its_columns_is_refused_in_one_sentence(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("params,tokens,loss\n1e6,2e7,3.1\n")
    with pytest.raises(ConfigError, match=r"has no column n_params; it needs n_params, tokens and loss"):
        scaling_lab.fit(str(tmp_path), str(table))
    with pytest.raises(ConfigError, match=r"has no finished points"):
        scaling_lab.fit(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"has no fit.json; run `scaling.py fit"):
        scaling_lab.predict(str(tmp_path), 1e12)


# The micro sweep's base on the command line: tiny with heads of 16, one layer per 64 of width, seq 64, batch 8.
MICRO_FLAGS = ["--config.model.d_model=64", "--config.model.n_layers=1", "--config.model.n_heads=4",
               "--config.model.n_kv_heads=2", "--config.model.d_ff=192", "--config.model.max_seq_len=64",
               "--config.data.seq_len=64", "--config.train.global_batch_size=8", "--config.optim.warmup_steps=10",
               "--config.train.eval_batches=2"]  # fmt: skip


def micro_base(corpus_dir):
    return micro_config(
        data=dict(source="text_files", data_dir=corpus_dir, seq_len=64),
        model=dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=64),
        mesh=dict(data=-1, fsdp=1), optim=dict(lr=3e-3, warmup_steps=10),
    )  # fmt: skip


def test_the_ladder_scales_the_base_shape_by_its_documented_rule(corpus_dir):
    base = micro_base(corpus_dir)  # head_dim 16, 2 query heads per kv head, aspect 64, MLP 3x
    rungs = scaling_sweep.ladder(base, 1e12)
    assert [r.d_model for r in rungs[:5]] == [32, 64, 96, 128, 160]
    for r in rungs:
        c = r.changes
        assert c["model.n_heads"] == r.d_model // 16 and c["model.n_kv_heads"] == c["model.n_heads"] // 2
        assert r.n_layers == max(2, round(r.d_model / 64)) and c["model.d_ff"] == 3 * r.d_model
        # N counts the matmul weights (the input embedding is a lookup): per layer 2 d^2 (q, o) + 2 d^2/2 (k, v)
        # + 3 d d_ff, plus norms, plus the output head d x vocab.
        d = r.d_model
        assert r.n_params == r.n_layers * (3 * d * d + 9 * d * d + 2 * d) + d + d * 384
    with pytest.raises(ConfigError, match=r"budget 1e\+09 FLOPs is too small for 3 sizes.*at least"):
        scaling_sweep.plan_points(base, [1e9], 3, "unused")


def run_script(*args, timeout=900, processes=1):
    """scripts/scaling.py on one CPU device per process (the 8 simulated ones would only add collectives to tiny
    models); with `processes`, that many cooperating processes through the local launcher."""
    env = {**os.environ, "XLA_FLAGS": ""}
    command = [sys.executable, "scripts/scaling.py", *args]
    if processes > 1:
        command = [sys.executable, "scripts/launch_local.py", "-n", str(processes), "--devices_per_process", "1",
                   "--", *command]  # fmt: skip
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow  # 294 s in CI (the largest single test): the suite passed 25 minutes with it
def test_a_micro_sweep_on_a_bucket_fits_and_checks_its_prediction(corpus_dir, bucket):
    """One budget of three sizes, through the script, with --out in a bucket: the sweep on two processes (each
    point trained by both, the lab's files written and its lines said by process 0 alone), then resumed, then
    fit and predict with a check of the prediction. (Two budgets would fit Approach 2 as well, at twice the
    CI time; the synthetic test covers it.)"""
    base, out, budget = micro_base(corpus_dir), f"{bucket.url}/sweep", 4e10
    flags = ["--config", "configs/tiny.py", *MICRO_FLAGS, f"--config.data.data_dir={corpus_dir}", "--out", out]
    log = run_script("sweep", *flags, "--budgets", "4e10", "--sizes", "3", processes=2)
    points = scaling_sweep.plan_points(base, [budget], 3, out)
    said = [re.findall(rf"^\[{i}\] \[\d/3\] C=", log, re.MULTILINE) for i in (0, 1)]
    assert len(points) == 3 and len(said[0]) == 3 and log.count("ETA") == 3 and not said[1]
    for p in points:
        metrics = [json.loads(x) for x in (wd.path(p.workdir) / "metrics.jsonl").read_text().splitlines()]
        trained = [m for m in metrics if "loss" in m]
        # Each point trains budget / FLOPs-per-token tokens (to within half a step) ...
        per_step = base.train.global_batch_size * base.data.seq_len * p.rung.flops_per_token
        assert abs(trained[-1]["sequences"] * base.data.seq_len * p.rung.flops_per_token - budget) <= per_step / 2
        # ... with warmup and cosine decay fitted to its own length: the last update is at the floor, the one
        # before it a step short of it.
        lr, floor, warmup = base.optim.lr, base.optim.lr * base.optim.min_lr_ratio, min(10, p.steps // 10)
        progress = (p.steps - 1 - warmup) / (p.steps - warmup)
        assert trained[-1]["step"] == p.steps
        assert trained[-1]["lr"] == pytest.approx(floor)
        if trained[-2]["step"] == p.steps - 1:
            assert trained[-2]["lr"] == pytest.approx(floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert math.isfinite(scaling_sweep.final_loss(p.workdir))

    again = run_script("sweep", *flags, "--budgets", "4e10", "--sizes", "3")
    assert again.count("finished before") == 3 and "compiled" not in again  # a finished sweep trains nothing

    fitted = json.loads(run_script("fit", "--out", out, "--resamples", "20", "--json"))
    assert fitted["points"] == 3 and math.isfinite(fitted["approach3"]["alpha"])
    assert fitted["approach2"] is None and "two budgets" in fitted["approach2_error"]
    assert len(list(csv.DictReader(io.StringIO((wd.path(out) / "points.csv").read_text())))) == 3
    assert all(wd.path(plot).read_bytes().startswith(b"\x89PNG") for plot in fitted["plots"])

    # At a budget the sweep covered, the check takes the sweep's own points: nothing is trained again.
    output = run_script("predict", "--out", out, "--budget", "4e10", "--train", "--neighbours", "0", "--json")
    assert "compiled" not in output and not (wd.path(out) / "check").exists()
    result = json.loads(output.strip().splitlines()[-1])
    assert len(result["measured"]["points"]) == 3
    m = result["model"]
    namespace = {}
    exec(wd.path(result["config_file"]).read_text(), namespace)  # noqa: S102 - the file the lab wrote
    predicted_cfg = namespace["get_config"]()
    assert (predicted_cfg.model.d_model, predicted_cfg.train.steps) == (m["d_model"], m["steps"])
    workdir = result["command"].split("--workdir ")[1]
    assert result["measured"]["loss_of_predicted_model"] == scaling_sweep.final_loss(workdir)
    assert math.isfinite(m["predicted_loss"])


def test_the_list_prints_a_train_command_per_point(corpus_dir, tmp_path):
    args = ["--config", "configs/tiny.py", "--config.data.seq_len=64", "--config.model.max_seq_len=64",
            f"--config.data.data_dir={corpus_dir}"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "scripts/scaling.py", "sweep", *args, "--budgets", "1e12,2e12", "--sizes", "3",
         "--out", str(tmp_path), "--list"], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    commands = out.stdout.strip().splitlines()
    assert len(commands) == 6 and not os.listdir(tmp_path)  # listing writes nothing
    for line in commands:
        assert line.startswith("python scripts/train.py --config=configs/tiny.py --config.data.seq_len=64")
        assert "--config.train.steps=" in line and f"--workdir={tmp_path}/C" in line
