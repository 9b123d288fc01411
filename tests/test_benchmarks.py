"""Every script in benchmarks/ runs, at its smallest setting, and prints the result line RESULTS.md records.

A renamed field or a broken import fails here instead of the next time someone
measures. The figures are not judged (machines are noisy): the line's fields
are, against the newest row of the same benchmark in RESULTS.md (numbers in a
field's name, such as a layer count, stand for any number).
"""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

TINY = ["--config", "configs/tiny.py", "--config.train.global_batch_size=8", "--config.data.seq_len=64"]
SYNTHETIC = [*TINY, "--config.data.source=synthetic"]


def quick(corpus_dir, out):
    """Each benchmark's smallest run: (script, arguments, the benchmark its line names)."""
    data = [*TINY, f"--config.data.data_dir={corpus_dir}"]
    prepared = os.path.join(os.path.dirname(out), "prepare")
    return [
        ("checkpoint.py", [*SYNTHETIC, "--repeats=1"], "checkpoint"),
        ("compile_layers.py", [*SYNTHETIC, "--layers=1"], "compile_layers"),
        ("context.py", [*SYNTHETIC, "--seq_lens=64", "--contexts=2", "--steps=1"], "context"),
        ("grouped_matmul.py", ["--rows=1024", "--d_model=256", "--d_ff=256", "--experts=4"], "grouped_matmul"),
        ("grpo.py", [*TINY, "--new_tokens=8", "--steps=1"], "grpo"),
        ("harness.py", [*SYNTHETIC, "--requests=16"], "harness"),
        ("input_pipeline.py", [*data, "--batches=2", "--steps=1"], "input_pipeline"),
        ("input_pipeline.py", [*data, "--per_core", "--batches=2"], "input_pipeline_per_core"),
        (
            "moe.py",
            [
                "--config",
                "configs/moe_tiny.py",
                *SYNTHETIC[2:],
                "--config.model.n_layers=2",
                "--experts=2",
                "--steps=1",
            ],
            "moe",
        ),
        ("overhead.py", [*SYNTHETIC, "--steps=1", "--rounds=1"], "overhead"),
        ("post_training.py", [*SYNTHETIC, "--steps=1", "--rounds=1"], "post_training"),
        ("prepare.py", ["--mb=2", "--small_mb=1", "--batches=2", f"--dir={prepared}"], "prepare"),
        (
            "pipeline_bubble.py",
            [*SYNTHETIC, "--stages=2", "--microbatches=2", "--steps=1", "--simulate_devices=2"],
            "pipeline_bubble",
        ),  # fmt: skip
        ("remat.py", [*SYNTHETIC, "--steps=1"], "remat"),
        (
            "quant.py",
            [
                *data,
                "--config.precision.compute_dtype=bfloat16",
                "--config.model.n_layers=1",
                "--config.train.steps=2",
                "--config.optim.warmup_steps=1",
                "--config.train.eval_every=2",
                "--config.train.eval_batches=1",
                "--steps=1",
            ],
            "quant",
        ),  # fmt: skip
        (
            "sliding_window.py",
            [
                "--config",
                "configs/gemma3_1b.py",
                "--config.model.sliding_window=32",
                "--seq_len=128",
                "--steps=1",
                "--target=",
            ],
            "sliding_window",
        ),  # fmt: skip
        ("linear_attention.py", ["--seq_lens=128", "--steps=1", "--target="], "linear_attention"),
        ("teacher_logits.py", [*data, "--windows=2", "--teacher_config=configs/quickstart.py"], "teacher_logits"),
        (
            "latent_cache.py",
            ["--config", "configs/deepseek_tiny.py", "--prompt=32", "--new=4", "--layers=1"],
            "latent_cache",
        ),  # fmt: skip
        ("restart.py", [*SYNTHETIC, "--config.train.steps=2", "--config.optim.warmup_steps=1"], "restart"),
        ("vs_pytorch.py", [*SYNTHETIC, "--steps=1", "--rounds=1"], "vs_pytorch"),
        (
            "memory_calibration.py",
            ["--configs=tiny", "--targets=v5e-4", "--remats=none", "--meshes=fsdp=4", f"--out={out}"],
            None,
        ),  # fmt: skip
        # Its GPU parts shrunk to run here (a CPU stands in for the card): every part runs and gives its row.
        ("gpu_proof.py", ["--small", "--checks=2", "--variants=full_b8", "--torch=0", f"--out={out}.gpu"], "gpu_proof"),
        # Its compiles need a MaxText checkout and its own Python (not in CI): the table of the recorded ones.
        ("vs_maxtext.py", ["--table"], "vs_maxtext"),
    ]


def recorded_fields() -> dict[str, set[str]]:
    """The figures' names in the newest RESULTS.md row of each benchmark, digits as N."""
    fields = {}
    with open(os.path.join(REPO, "benchmarks", "RESULTS.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if re.fullmatch(r"\d{4}-\d\d-\d\d", cells[0]):
                fields[cells[1]] = {re.sub(r"\d+", "N", kv.split("=")[0]) for kv in cells[-1].split(", ")}
    return fields


def test_every_benchmark_script_has_a_smoke_run():
    helpers = {"record.py", "timing.py"}
    scripts = {f for f in os.listdir(os.path.join(REPO, "benchmarks")) if f.endswith(".py")} - helpers
    assert scripts == {script for script, _, _ in quick("", "")}


# The smoke runs that took 10-36 s of CPU each on 2026-11-29 (they train, prepare or compile for a TPU several
# times over), and those that took 11-16 s in the suite later that day (vs_pytorch, pipeline_bubble,
# input_pipeline, overhead, grpo): drills, in pytest -m slow, which CI runs too. The rest, 1-9 s each, stay.
DRILLS = {"quant.py", "prepare.py", "post_training.py", "moe.py", "harness.py", "restart.py", "memory_calibration.py",
          "gpu_proof.py", "sliding_window.py", "remat.py", "linear_attention.py", "teacher_logits.py", "vs_pytorch.py",
          "pipeline_bubble.py", "overhead.py", "grpo.py", "input_pipeline.py"}  # fmt: skip


def smoke_runs() -> list:
    """One test per run: each is a process of its own, so the suite's workers share them out
    (tests/conftest.py's SPLIT)."""
    return [pytest.param(i, id=name or script.removesuffix(".py"), marks=[pytest.mark.slow] * (script in DRILLS))
            for i, (script, _, name) in enumerate(quick("", ""))]  # fmt: skip


@pytest.mark.parametrize("run_index", smoke_runs())
def test_every_benchmark_runs_and_prints_what_results_records(corpus_dir, tmp_path, run_index):
    pytest.importorskip("torch")  # vs_pytorch.py and harness.py: the hf extra, which CI installs
    pytest.importorskip("lm_eval")  # harness.py: the eval extra, which CI installs
    pytest.importorskip("libtpu")  # memory_calibration.py: the tpu extra, which CI installs
    pytest.importorskip("apache_beam")  # prepare.py: the beam extra, which CI installs
    pytest.importorskip("megatron.core")  # prepare.py: the formats extra, which CI installs
    fields = recorded_fields()
    out = tmp_path / "calibration.jsonl"
    script, args, name = quick(corpus_dir, out)[run_index]
    run = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, f"{script}: {run.stderr[-3000:]}"
    if name is None:  # the memory calibration: its compiles in --out, and the README's table
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [(r["config"], r["remat"], r["mesh"], r["compiler"]) for r in lines] == [
            ("tiny", "none", "fsdp=4", "v5e-4")
        ]
        assert all(r["xla"]["total"] > 0 for r in lines)
        assert run.stdout.count("| tiny | none |") == 1
        return
    if name == "gpu_proof":  # its rows: every part ran, none failed or was skipped
        rows = [json.loads(line) for line in open(f"{out}.gpu/gpu_proof.jsonl")]
        assert [r["part"] for r in rows] == ["env", "matmul", "llm_full_b8"], rows
        assert all(r["tokens_per_s"] > 0 and r["xla_gib"] > 0 for r in rows[2:]), rows
        return
    if name == "vs_maxtext":  # a row of the table for each recorded compile, both trainers side by side
        with open(os.path.join(REPO, "benchmarks", "report", "vs_maxtext.jsonl")) as f:
            recorded = [json.loads(line) for line in f]
        assert {"ours", "maxtext"} <= {r["trainer"] for r in recorded}
        for r in recorded:
            assert f"| {r['shape']} | {r['target']} | {r['trainer']} |" in run.stdout
        return
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert line["benchmark"] == name and re.fullmatch(r"[0-9a-f]{7}\+?", line["commit"]), line
    figures = {re.sub(r"\d+", "N", k) for k in line} - {"benchmark", "commit"}
    assert figures == fields[name], f"{script}: {sorted(figures ^ fields[name])}"
