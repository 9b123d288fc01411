"""Bad input: one clear sentence, before compiling, and nothing on disk damaged."""

import os
import subprocess
import sys

import pytest
from conftest import micro_config

from trainer.config.errors import ConfigError
from trainer.run.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def unknown_key():
    cfg = micro_config()
    cfg.unlock()
    cfg.optim.lrr = 1.0
    return cfg


CASES = {
    "mesh larger than the devices": (
        lambda: micro_config(mesh=dict(data=2, fsdp=8, tensor=1)),
        "needs 16 devices but 8",
    ),
    "mesh axes that do not divide the devices": (
        lambda: micro_config(mesh=dict(data=3, fsdp=-1)),
        "does not divide the 8",
    ),
    "two wildcard axes": (lambda: micro_config(mesh=dict(data=-1, fsdp=-1)), "at most one axis"),
    "batch not divisible over data x fsdp": (
        lambda: micro_config(train=dict(global_batch_size=12)),
        "12 sequences .* does not divide over data x fsdp x expert = 8",
    ),
    "microbatch not divisible": (
        lambda: micro_config(train=dict(global_batch_size=16, grad_accum_steps=4)),
        "microbatch of 4 sequences",
    ),
    "kv heads not divisible over tensor": (
        lambda: micro_config(mesh=dict(fsdp=2, tensor=4)),
        "model.n_kv_heads=2 does not divide over mesh.tensor=4",
    ),
    "heads not divisible over tensor": (
        lambda: micro_config(mesh=dict(fsdp=1, tensor=8)),
        "model.n_heads=4 does not divide over mesh.tensor=8",
    ),
    "unknown key": (unknown_key, "unknown config key 'optim.lrr'"),
    "a width that heads do not divide": (
        lambda: micro_config(model=dict(d_model=66)),
        r"model.d_model=66 is not a multiple of model.n_heads=4; change one, or set model.head_dim",
    ),
    "an odd head size": (lambda: micro_config(model=dict(head_dim=15)), r"the head size 15 .* must be even for RoPE"),
    "more experts per token than experts": (
        lambda: micro_config(model=dict(moe=dict(num_experts=4, experts_per_token=6))),
        "model.moe.experts_per_token=6 exceeds model.moe.num_experts=4",
    ),
    "experts that the expert axis does not divide": (
        lambda: micro_config(model=dict(moe=dict(num_experts=6)), mesh=dict(expert=4, fsdp=2)),
        "model.moe.num_experts=6 does not divide over mesh.expert=4",
    ),
    "MoE layers that do not make whole units": (
        lambda: micro_config(model=dict(n_layers=4, moe=dict(num_experts=4, dense_layers=1, every=2))),
        r"the 3 layers after model.moe.dense_layers=1 do not split into units of model.moe.every=2",
    ),
    "an expert axis without experts": (
        lambda: micro_config(mesh=dict(expert=2, fsdp=4)),
        "mesh.expert=2 splits experts, but the model has none",
    ),
    "a width the expert axis does not divide": (  # the default rule shards embed over expert too
        lambda: micro_config(model=dict(d_model=36, head_dim=16, moe=dict(num_experts=4)), mesh=dict(expert=4, fsdp=2)),
        r"model.d_model=36 does not divide over mesh.fsdp x mesh.expert=8 \(mesh.rules.embed",
    ),
    "a width a custom rule's axes do not divide": (
        lambda: micro_config(
            model=dict(d_model=36, head_dim=16), mesh=dict(fsdp=4, tensor=2, rules=dict(embed=("fsdp", "tensor")))
        ),
        r"model.d_model=36 does not divide over mesh.fsdp x mesh.tensor=8 \(mesh.rules.embed",
    ),
    "a capacity factor of zero": (
        lambda: micro_config(model=dict(moe=dict(num_experts=4, impl="capacity", capacity_factor=0.0))),
        r"model.moe.capacity_factor=0.0 must be in \(0, inf\)",
    ),
    "experts in pipeline stages": (
        lambda: micro_config(
            model=dict(moe=dict(num_experts=4)), mesh=dict(stage=2, fsdp=4), train=dict(pipeline_microbatches=2)
        ),  # fmt: skip
        "experts inside pipeline stages are not supported",
    ),
    "unknown remat policy": (
        lambda: micro_config(model=dict(remat="sometimes")),
        "model.remat='sometimes' is not one of none, full",
    ),
    "rule naming a missing mesh axis": (
        lambda: micro_config(mesh=dict(rules=dict(mlp=("model",)))),
        "mesh axis 'model'",
    ),
    "schedule longer than training": (
        lambda: micro_config(optim=dict(warmup_steps=30)),
        r"exceeds train.steps=20; lower --config.optim.warmup_steps, or raise "
        r"--config.train.steps",
    ),
    "vocabulary smaller than the tokenizer": (
        lambda: micro_config(model=dict(vocab_size=128), data=dict(source="text_files")),
        "259 ids but model.vocab_size=128",
    ),
    "unknown tracker": (
        lambda: micro_config(train=dict(trackers=("tensorboard", "mlflow"))),
        "train.trackers='mlflow' is not one of tensorboard, wandb",
    ),
    "sample prompt longer than the context": (
        lambda: micro_config(train=dict(sample_prompts=("x" * 60,), eval_every=5, sample_tokens=8)),
        "and train.sample_tokens=8 make 69 tokens, more than model.max_seq_len=64",
    ),
    "mixture weights that sum to zero": (
        lambda: micro_config(data=dict(source="text_files", mixture=("python_stdlib:0", "notes:0"))),
        "the weights must sum to a positive number",
    ),
    "validation share out of range": (
        lambda: micro_config(data=dict(source="text_files", validation_fraction=0.6)),
        r"data.validation_fraction=0.6 must be in \(0, 0.5\]",
    ),
    "no validation share": (
        lambda: micro_config(data=dict(source="text_files", validation_fraction=0.0)),
        r"data.validation_fraction=0.0 must be in \(0, 0.5\]",
    ),
    "unknown mixture unit": (
        lambda: micro_config(data=dict(source="text_files", mixture_unit="bytes")),
        "data.mixture_unit='bytes' is not one of tokens, documents",
    ),
    "prompts mixed by tokens": (
        lambda: micro_config(data=dict(source="text_files", format="prompts", mixture=("a:1", "b:1"))),
        "a mixture of prompts corpora draws prompts, its weights are shares of the prompts; set "
        "data.mixture_unit=documents",
    ),
    "mixture corpus that is not prepared": (
        lambda: micro_config(data=dict(source="tfds", data_dir="/nonexistent", mixture=("a:1", "b:1"))),
        "dataset 'a' is not prepared under /nonexistent",
    ),
    "sequence the context axis does not split in zig-zag halves": (
        lambda: micro_config(mesh=dict(fsdp=1, data=-1, context=8), data=dict(seq_len=24)),
        "data.seq_len=24 does not split into 2 x 8 equal chunks .* use a multiple of 16",
    ),
    "context axis with pipeline stages": (
        lambda: micro_config(mesh=dict(fsdp=1, data=-1, stage=2, context=2), train=dict(pipeline_microbatches=2)),
        "mesh.context=2 with mesh.stage=2: context parallelism inside pipeline stages is not supported",
    ),
    "context axis on a kernel that cannot take its blocks": (
        lambda: micro_config(mesh=dict(fsdp=1, data=-1, context=2), model=dict(attention="splash")),
        "model.attention=splash cannot take the context axis's blocks",
    ),
    "unknown context attention": (
        lambda: micro_config(model=dict(context_attention="ulysses")),
        "model.context_attention='ulysses' is not one of ring, all_gather",
    ),
    "DPO without the weights it starts from": (
        lambda: micro_config(data=dict(source="text_files", format="preference", paths="/x/*.jsonl")),
        r"DPO \(data.format=preference\) measures the policy against the weights it starts from: give them with "
        r"--config.checkpoint.init_from",
    ),
    "conversations from a source that is not prepared here": (
        lambda: micro_config(data=dict(format="chat")),
        "data.format=chat reads .jsonl or .parquet rows prepared here: set data.source=text_files",
    ),
    "a window as long as the sequence": (
        lambda: micro_config(model=dict(sliding_window=64)),
        "model.sliding_window=64 is not shorter than model.max_seq_len=64, so every local layer would attend as a "
        "global one does",
    ),
    "a window in pipeline stages": (
        lambda: micro_config(model=dict(sliding_window=8), mesh=dict(stage=2), train=dict(pipeline_microbatches=2)),
        "local layers inside pipeline stages are not supported",
    ),
    "latent ranks that the tensor axis does not divide": (
        lambda: micro_config(
            model=dict(n_kv_heads=4, mla=dict(kv_rank=21, nope_dim=8, rope_dim=8, v_dim=16)),
            mesh=dict(fsdp=4, tensor=2, rules=dict(kv_latent=("tensor",))),
        ),  # fmt: skip
        r"model.mla.kv_rank=21 does not divide over mesh.tensor=2 \(mesh.rules.kv_latent",
    ),
    "attention sinks with a kernel that has none": (
        lambda: micro_config(model=dict(attention_sinks=True, attention="dot_product")),
        r"model.attention_sinks with model.attention=dot_product \(dot_product on cpu\): only the xla and splash",
    ),
    "a window with experts": (
        lambda: micro_config(model=dict(sliding_window=8, moe=dict(num_experts=4))),
        r"model.sliding_window=8 with experts \(model.moe.num_experts=4\) is not implemented",
    ),
    "latent values wider than a query head": (
        lambda: micro_config(model=dict(n_kv_heads=4, mla=dict(kv_rank=16, nope_dim=8, rope_dim=8, v_dim=32))),
        "model.mla.v_dim=32 exceeds a query head's nope_dim \\+ rope_dim = 16",
    ),
    "multi-token prediction in pipeline stages": (
        lambda: micro_config(model=dict(mtp=dict(depth=1)), mesh=dict(stage=2), train=dict(pipeline_microbatches=2)),
        "multi-token prediction with pipeline stages is not supported; use mesh.stage=1",
    ),
    "dataset that is not prepared": (
        lambda: micro_config(data=dict(source="tfds", name="no_such_dataset", data_dir="/nonexistent")),
        "not prepared",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_config_stops_before_writing_anything(case, tmp_path):
    make, message = CASES[case]
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message) as info:
        train(make(), str(workdir))
    assert "\n" not in str(info.value)
    assert not workdir.exists()


def test_a_checkpoint_of_another_model_is_refused_and_kept(tmp_path):
    workdir = tmp_path / "run"
    train(micro_config(train=dict(steps=2), checkpoint={"every_steps": 2}), str(workdir))
    before = {p: os.path.getmtime(os.path.join(dp, p)) for dp, _, files in os.walk(workdir) for p in files}
    config_text = (workdir / "config.json").read_text()
    with pytest.raises(ConfigError, match="belongs to another run .model.d_model=64 there, 128 here"):
        train(micro_config(model=dict(d_model=128), train=dict(steps=4)), str(workdir))
    after = {p: os.path.getmtime(os.path.join(dp, p)) for dp, _, files in os.walk(workdir) for p in files}
    assert before == after and (workdir / "config.json").read_text() == config_text


def test_an_unwritable_workdir_fails_before_training(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot write checkpoints under .*a_file/run"):
        train(micro_config(), str(tmp_path / "a_file" / "run"))


def test_an_unwritable_local_tier_fails_before_training_and_before_the_workdir_is_made(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    cfg = micro_config(checkpoint={"local_dir": str(tmp_path / "a_file" / "local")})
    with pytest.raises(ConfigError, match=r"checkpoint.local_dir=.*a_file/local.: cannot write there \(Not a direc"):
        train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_workdir_in_an_unsupported_store_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="s3://bucket/run: only local paths and gs:// buckets"):
        train(micro_config(), "s3://bucket/run")


def test_resuming_with_another_data_stream_names_the_keys(tmp_path):
    workdir = str(tmp_path / "run")
    train(micro_config(train=dict(steps=2)), workdir)
    with pytest.raises(ConfigError, match="data.seq_len=32 there, 16 here; train.global_batch_size=8 there, 16 here"):
        train(micro_config(data=dict(seq_len=16), train=dict(steps=4, global_batch_size=16)), workdir)


@pytest.mark.parametrize(
    "args, named",
    [
        (["--config", "configs/tiny.py", "--config.optim.lrr=1"], "lrr"),
        (["--config", "configs/nope.py"], "error: --config=configs/nope.py names no file; give a configs/*.py recipe"),
        (["--config", "runs/nope/config.json"], "error: --config=runs/nope/config.json names no file;"),
        (
            ["--config", "configs"],
            "error: --config=configs is a folder; give a configs/*.py recipe or a run's "
            "config.json (it holds no run's config.json).",
        ),
        (
            ["--config", "configs/distill_tiny.py", "--config.distill.temperature=2"],
            "is now --config.distill.divergence_temperature and --config.distill.sample_temperature; use the new name",
        ),
        (["--config", "configs/tiny.py", "--multihost"], "--multihost found no cluster to join"),
    ],
    ids=["misspelt key", "missing config file", "missing saved config", "a folder", "renamed key", "no cluster"],
)
def test_the_script_prints_one_line_and_fails(tmp_path, args, named):
    result = subprocess.run(
        [sys.executable, "scripts/train.py", *args, f"--workdir={tmp_path / 'run'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    # One line and nothing else: no accelerator plugin's start-up words (the gpu and tpu extras are installed).
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    assert named in result.stderr and result.stdout == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "script, args, said",
    [
        ("train.py", ["--config.train.step=600"],
         "error: --config.train.step is not a config key; did you mean --config.train.steps? (every key: "
         "trainer/config/__init__.py)"),
        ("eval.py", ["--max_batches=-1"], "error: --max_batches=-1 must be 0 (the whole split) or more."),
        ("lm_eval.py", ["--tasks=hellaswag", "--limit=-1"],
         "error: --limit=-1 must be 0 (every document) or more: a count of documents per task, or below 1 a "
         "share of them."),
    ],
    ids=["misspelt key", "negative max_batches", "negative limit"],
)  # fmt: skip
def test_a_flag_no_command_can_take_is_one_plain_sentence_before_anything_loads(tmp_path, script, args, said):
    result = subprocess.run([sys.executable, f"scripts/{script}", "--config", "configs/tiny.py", *args,
                             f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip() == said
    assert not (tmp_path / "run").exists()


def test_commands_that_need_no_accelerator_print_only_their_own_lines(tmp_path):
    """With the gpu and tpu extras installed on a machine with neither: no CUDA-driver line, plugin traceback or
    libtpu warning from the scaling lab, the planner's TPU and GPU targets, or preparing data."""
    pytest.importorskip("libtpu")
    commands = [
        ["scripts/scaling.py", "fit", f"--out={tmp_path / 'lab'}"],
        ["scripts/plan.py", "--config", "configs/tiny.py", "--target=v5e-4", "--no_compile"],
        ["scripts/plan.py", "--config", "configs/tiny.py", "--target=h100-8", "--no_compile"],
        ["scripts/prepare_data.py", "--config", "configs/tiny.py", f"--config.data.data_dir={tmp_path / 'tfds'}",
         f"--config.data.paths={REPO}/trainer/training/*.py", "--config.data.validation_fraction=0.5"],
    ]  # fmt: skip
    for command in commands:
        result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
        words = result.stderr.strip().splitlines()
        if command[1] == "fit":  # an empty lab: its one sentence
            assert result.returncode == 1 and len(words) == 1 and words[0].startswith("error: "), result.stderr
        else:
            assert result.returncode == 0 and words == [], result.stderr


def test_every_numeric_key_has_a_range_that_holds_its_default():
    from trainer.config import RANGES, defaults
    from trainer.config.forms import flatten
    from trainer.training.validation import in_range

    numbers = {k: v for k, v in flatten(defaults()).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert sorted(RANGES) == sorted(numbers)
    assert all(in_range(value, RANGES[key]) for key, value in numbers.items())


def just_outside(spec: str, integer: bool):
    """The nearest values a range written as config.Num writes them leaves out, found without its parser."""
    lows, highs, points = [], [], []
    for part in spec.split(" or "):
        if part[0] not in "[(":
            points.append(float(part))
            continue
        low, high = (float(x) for x in part[1:-1].split(","))
        step = 1 if integer else 1e-3
        lows.append(low - step if part[0] == "[" else low)
        if high != float("inf"):
            highs.append(high + step if part[-1] == "]" else high)
    return [int(v) if integer else v for v in lows + highs if v not in points]


def test_a_value_outside_any_keys_range_is_refused_naming_key_value_and_range():
    """Every numeric key, at each value just outside its range, is refused in one sentence before anything runs."""
    from trainer.config import RANGES, defaults
    from trainer.config.forms import flatten, with_changes
    from trainer.training.validation import validate

    known, tried = flatten(defaults()), 0
    for key, spec in RANGES.items():
        integer = isinstance(known[key], int)
        for value in just_outside(spec, integer):
            cfg = with_changes(micro_config(), {key: value})
            with pytest.raises(ConfigError) as info:
                validate(cfg)
            said = str(info.value)
            assert said.startswith(f"{key}={value!r} must be ") and spec.split(" or ")[-1] in said, said
            assert "\n" not in said
            tried += 1
    assert tried >= len(RANGES)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"optim.lr": 0.0}, r"optim.lr=0.0 must be in \(0, inf\)\."),
        ({"optim.lr": -1e-3}, r"optim.lr=-0.001 must be in \(0, inf\)\."),
        ({"optim.b1": -0.1}, r"optim.b1=-0.1 must be in \[0, 1\)\."),
        ({"optim.b2": 1.5}, r"optim.b2=1.5 must be in \[0, 1\)\."),
        ({"optim.eps": -1e-8}, r"optim.eps=-1e-08 must be in \(0, inf\)\."),
        # 0/0 in Adam's update wherever a gradient is exactly zero (an MoE router bias, an absent token's row)
        ({"optim.eps": 0.0}, r"optim.eps=0.0 must be in \(0, inf\)\."),
        # judged from the first step against running means of 0: every step a spike, none ever applied
        ({"stability.stats_warmup": 0}, r"stability.stats_warmup=0 must be in \[1, inf\)\."),
        ({"optim.weight_decay": -0.1}, r"optim.weight_decay=-0.1 must be in \[0, inf\)\."),
        ({"optim.z_loss": -1e-4}, r"optim.z_loss=-0.0001 must be in \[0, inf\)\."),
        ({"optim.clip_norm": -1.0}, r"optim.clip_norm=-1.0 must be in \[0, inf\)\."),
        ({"model.init_std": 0.0}, r"model.init_std=0.0 must be in \(0, inf\)\."),
        ({"model.rope_theta": 0.0}, r"model.rope_theta=0.0 must be in \(1, inf\)\."),
        ({"model.norm_eps": -1e-5}, r"model.norm_eps=-1e-05 must be in \(0, inf\)\."),
        ({"model.rope_scaling.factor": 0.5}, r"model.rope_scaling.factor=0.5 must be in \[1, inf\)\."),
        ({"model.rope_scaling.factor": 8.0, "model.rope_scaling.high_freq_factor": 1.0},
         r"model.rope_scaling.high_freq_factor=1.0 must exceed low_freq_factor=1.0"),
        ({"precision.initial_loss_scale": 0.0}, r"precision.initial_loss_scale=0.0 must be in \(0, inf\)\."),
        ({"precision.loss_scale_growth_interval": 0}, r"precision.loss_scale_growth_interval=0 must be in \[1, inf"),
        ({"train.seed": -1}, r"train.seed=-1 must be in \[0, 2147483647\]\."),
        ({"stability.bad_window": 0}, r"stability.bad_window=0 must be in \[1, inf\)\."),
        ({"stability.spike_factor": 0.5}, r"stability.spike_factor=0.5 must be 0 or in \(1, inf\)\."),
        ({"mesh.fsdp": 0}, r"mesh.fsdp=0 must be -1 or in \[1, inf\)\."),
        ({"train.hang_seconds": float("nan")}, r"train.hang_seconds=nan must be in \[0, inf\)\."),
        ({"stability.max_bad_steps": 60}, r"stability.max_bad_steps=60 bad steps can never occur within "
                                          r"stability.bad_window=50 steps"),
    ],
)  # fmt: skip
def test_values_no_run_can_want_are_refused(changes, message, tmp_path):
    from trainer.config.forms import with_changes

    cfg = with_changes(micro_config(), changes)
    with pytest.raises(ConfigError, match=message):
        train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_no_bad_step_count_rolls_back_when_max_bad_steps_is_zero():
    """0 is "off", as for stability.spike_factor and diverge_steps: a healthy run (no bad step) and a run of bad
    steps are both left alone by the count; divergence is still judged."""
    from trainer.training.stability import trouble

    cfg = micro_config(stability=dict(max_bad_steps=0))
    assert trouble(cfg, 0, 0) is None and trouble(cfg, 50, 0) is None
    assert "loss above" in trouble(cfg, 0, cfg.stability.diverge_steps)
    assert trouble(micro_config(), 4, 0) == "4 bad steps in the last 50"


def test_keys_the_chosen_settings_never_read_are_named_in_a_warning():
    from trainer.config.forms import with_changes
    from trainer.training.validation import unread_settings

    cfg = with_changes(micro_config(), {"optim.schedule": "wsd", "optim.decay_steps": 500, "optim.name": "lion",
                                        "optim.eps": 1e-6, "precision.initial_loss_scale": 1024.0,
                                        "optim.momentum": 0.5, "optim.decay_fraction": 0.3})  # fmt: skip
    lines = unread_settings(cfg)
    assert lines == [
        "optim.decay_steps=500 is read only when optim.schedule is cosine or linear; with optim.schedule=wsd it "
        "does nothing.",
        "optim.eps=1e-06 is read only when optim.name is adamw; with optim.name=lion it does nothing.",
        "optim.momentum=0.5 is read only when optim.name is sgd; with optim.name=lion it does nothing.",
        "precision.initial_loss_scale=1024.0 is read only when precision.loss_scaling is dynamic; with "
        "precision.loss_scaling=auto (none with float32 compute) it does nothing.",
    ]
    # The same keys where their settings read them: nothing to say.
    read = with_changes(cfg, {"optim.schedule": "cosine", "optim.decay_steps": 5, "optim.decay_fraction": 0.2,
                              "optim.name": "sgd", "optim.eps": 1e-8,
                              "precision.compute_dtype": "float16"})  # fmt: skip
    assert unread_settings(read) == []
    # Experts' keys: with none, every one set is named; with experts, the one the chosen impl never reads.
    dense = with_changes(micro_config(), {"model.moe.d_ff": 96, "model.moe.router_bias": 1e-3,
                                          "model.moe.experts_per_token": 4})  # fmt: skip
    assert unread_settings(dense) == [
        f"model.moe.{key} is read only when model.moe.num_experts is not 0; with model.moe.num_experts=0 it does "
        "nothing."
        for key in ("experts_per_token=4", "d_ff=96", "router_bias=0.001")
    ]
    dropless = with_changes(dense, {"model.moe.num_experts": 8, "model.moe.capacity_factor": 2.0})
    assert unread_settings(dropless) == [
        "model.moe.capacity_factor=2.0 is read only when model.moe.impl is capacity; with "
        "model.moe.impl=dropless it does nothing."
    ]
    assert unread_settings(with_changes(dropless, {"model.moe.impl": "capacity"})) == []
    # The local checkpoint tier's keys, without a local_dir.
    assert unread_settings(with_changes(micro_config(), {"checkpoint.local_every_steps": 10})) == [
        "checkpoint.local_every_steps=10 is read only when checkpoint.local_dir is not ''; with "
        "checkpoint.local_dir='' it does nothing."
    ]


def test_held_back_start_up_words_are_shown_when_the_start_up_fails(capfd, monkeypatch):
    """What JAX's plugins write while held back (C++ and Python alike write to file descriptor 2) is dropped
    when the step succeeds and written out, in order, when it raises: then it is the explanation."""
    from parallelism.accelerators import stderr_held_back

    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))  # a script's stderr: descriptor 2 itself

    with stderr_held_back():
        os.write(2, b"plugin: no driver\n")
        print("python: a warning", file=sys.stderr)
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError, match="backend failed"), stderr_held_back():
        os.write(2, b"plugin: no driver\n")
        print("python: the reason", file=sys.stderr, flush=True)
        raise RuntimeError("backend failed")
    assert capfd.readouterr().err == "plugin: no driver\npython: the reason\n"
    print("after", file=sys.stderr, flush=True)  # stderr is this process's own again
    assert capfd.readouterr().err == "after\n"


def test_a_json_line_that_is_not_json_is_named_by_its_files_line(tmp_path):
    """The parser counts lines of the one line it was given (always 'line 1'): the sentence gives the file's
    line, and the parser's column."""
    from trainer.data import corpora

    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}\n'
    (tmp_path / "rows.jsonl").write_text(good * 2 + '{"messages": oops}\n')
    data = micro_config(data=dict(source="text_files", format="chat", name="broken", paths=str(tmp_path / "rows.jsonl"),
                                  data_dir=str(tmp_path / "tfds"))).data  # fmt: skip
    with pytest.raises(ConfigError, match=r"^line 3 of .*rows.jsonl is not JSON \(Expecting value at column 14\); "
                                          r"fix or remove that line\.$"):  # fmt: skip
        corpora.prepare(data, say=lambda *_: None)


def test_the_data_line_says_whether_the_tokens_come_from_a_store_or_a_tokenizer():
    from trainer.data import corpora

    data = micro_config(data=dict(source="text_files", name="notes")).data
    assert corpora.describe(data) == ("data: notes (text), tokenised on the fly by the byte tokenizer "
                                      "(data.tokenized=true reads a tokenised store instead)")  # fmt: skip
    data.tokenized = True
    assert corpora.describe(data) == "data: notes (text), read from its tokenised store (data.tokenized=true)"
