"""Knowledge distillation (distill.*, trainer/objectives/distill.py): the divergence against TRL's
GKDTrainer.generalized_jsd_loss; offline with the whole vocabulary equal to online; a distilling run on 8
devices equal to one device and resumed exactly; the refusals, before anything compiles."""

import json
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, cli_args, micro_config

from trainer.config.errors import ConfigError
from trainer.config.forms import with_changes
from trainer.objectives import distill
from trainer.objectives.language_model import target_weights
from trainer.run.loop import train
from trainer.training import resume
from trainer.training.setup import build
from trainer.training.teacher import teacher_config


def settings(beta, temperature, alpha=0.5):
    return types.SimpleNamespace(beta=beta, divergence_temperature=temperature, alpha=alpha)


def test_trls_gkd_settings_give_gkd_trainers_own_loss():
    """A GKD recipe ported by docs/post_training.md's table (TRL's GKDConfig defaults: temperature 0.9, which
    samples; beta 0.5; lmbda 0.5; no cross-entropy) gives TRL 1.16's GKDTrainer.compute_loss on the same two
    models' logits: TRL's divergence is at temperature 1, whatever GKDConfig.temperature says."""
    torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
    gkd = pytest.importorskip(
        "trl.experimental.gkd", reason="the post extra is not installed: pip install -e '.[post]'"
    )
    args = gkd.GKDConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False)
    cfg = micro_config()
    cfg.distill.update(alpha=1.0, beta=args.beta, on_policy=args.lmbda, sample_temperature=args.temperature)
    assert (cfg.distill.divergence_temperature, cfg.distill.sample_temperature) == (1.0, 0.9)
    rng = np.random.default_rng(1)
    student, teacher = (rng.normal(0, 2, (2, 9, 40)).astype(np.float32) for _ in range(2))
    labels = np.where(rng.random((2, 9)) < 0.7, rng.integers(0, 40, (2, 9)), -100)

    class Fixed(torch.nn.Module):  # a model whose logits are given: compute_loss runs as TRL wrote it
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.tensor(logits)

        def forward(self, input_ids, attention_mask):
            return types.SimpleNamespace(logits=self.logits)

    trainer = types.SimpleNamespace(teacher_model=Fixed(teacher), beta=args.beta, temperature=args.temperature,
                                    generalized_jsd_loss=gkd.GKDTrainer.generalized_jsd_loss)  # fmt: skip
    inputs = {"input_ids": torch.zeros((2, 9), dtype=torch.long), "attention_mask": torch.ones((2, 9)),
              "labels": torch.tensor(labels)}  # fmt: skip
    theirs = float(gkd.GKDTrainer.compute_loss(trainer, Fixed(student), inputs))
    weights = (labels[:, 1:] != -100).astype(np.float32)
    identity = lambda x: x  # noqa: E731
    sums = distill.chunked_sums(identity, student[:, :-1], identity, teacher[:, :-1], np.maximum(labels[:, 1:], 0),
                                weights, cfg.distill, 0)  # fmt: skip
    ours = cfg.distill.alpha * float(sums[3]) / weights.sum()  # alpha 1: no cross-entropy, as GKD's loss
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_the_divergence_is_trls_generalized_jsd_for_every_beta_and_temperature():
    """TRL 1.16's GKDTrainer.generalized_jsd_loss (trl.experimental.gkd, with labels: a mean over the labelled
    positions) on the same logits, for beta 0 (forward KL), 0.5 and 1 (reverse KL) at temperatures 1 and 2;
    and the same sums in chunks, and from each position's whole-vocabulary "top k" (offline's form)."""
    torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
    gkd = pytest.importorskip(
        "trl.experimental.gkd", reason="the post extra is not installed: pip install -e '.[post]'"
    )
    rng = np.random.default_rng(0)
    student, teacher = (rng.normal(0, 2, (2, 8, 40)).astype(np.float32) for _ in range(2))
    weights = (rng.random((2, 8)) < 0.7).astype(np.float32)
    targets = rng.integers(0, 40, (2, 8))
    labels = np.where(weights > 0, targets, -100)
    identity = lambda x: x  # noqa: E731 - features that are the logits already
    vocab = np.broadcast_to(np.arange(40), (2, 8, 40))
    for beta in (0.0, 0.5, 1.0):
        for temperature in (1.0, 2.0):
            theirs = float(gkd.GKDTrainer.generalized_jsd_loss(torch.tensor(student), torch.tensor(teacher),
                                                               labels=torch.tensor(labels), beta=beta,
                                                               temperature=temperature))  # fmt: skip
            s = settings(beta, temperature)
            per = distill.divergence(jnp.asarray(student), jnp.asarray(teacher), beta, temperature)
            assert float(jnp.sum(per * weights) / weights.sum()) == pytest.approx(theirs, rel=1e-5), (beta, temperature)
            whole = distill.chunked_sums(identity, student, identity, teacher, targets, weights, s, 0)
            chunks = distill.chunked_sums(identity, student, identity, teacher, targets, weights, s, 4)
            top = distill.chunked_sums(identity, student, None, (vocab, teacher), targets, weights, s, 4)
            for got in (whole, chunks, top):
                np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-6)
            assert float(whole[3]) / weights.sum() == pytest.approx(theirs, rel=1e-5)


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A teacher of another size and family than micro_config's student (a Qwen3: query/key norms, 3 layers of
    96, against a Llama of 2 layers of 64), trained 6 steps."""
    path = str(tmp_path_factory.mktemp("teacher") / "run")
    teacher = micro_config(model=dict(n_layers=3, d_model=96, qk_norm=True), train=dict(steps=6),
                           checkpoint={"every_steps": 3})  # fmt: skip
    train(teacher, path)
    return path


def student(teacher: str, **sections):
    cfg = micro_config(**sections)
    cfg.distill.update(teacher=teacher, alpha=0.3, beta=0.5, divergence_temperature=2.0, sample_temperature=2.0)
    return cfg


def test_a_distilling_step_on_8_devices_equals_one_device_and_logs_the_models_own_figures(teacher_run):
    """On data 2 x fsdp 2 x tensor 2 with two microbatches, three steps give one device's losses and weights
    (the teacher sharded by its own logical axes, an input never changed). The first step's logged
    cross-entropy and divergence are those of the two models' logits computed apart (numpy's log-softmax, and
    the divergence checked against TRL above), and its loss (1 - alpha) x the one + alpha x the other."""
    mesh = dict(data=2, fsdp=2, tensor=2)
    one, eight = (build(student(teacher_run, mesh=m, train=dict(grad_accum_steps=2)), devices)
                  for m, devices in ((dict(fsdp=1), jax.devices()[:1]), (mesh, None)))  # fmt: skip
    rng = np.random.default_rng(3)
    batch = {"tokens": rng.integers(0, 384, (8, 32)).astype(np.int32),
             "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
             "segment_ids": np.repeat(np.array([[1] * 20 + [2] * 12]), 8, axis=0).astype(np.int32)}  # fmt: skip
    results = []
    for setup in (one, eight):
        taught = teacher_config(setup.cfg)
        weights = resume.load_init_params(taught, setup.teacher)[0]
        before = jax.tree.map(np.asarray, weights)
        state, step, logged = setup.new_state(), setup.train_step(), []
        start = jax.tree.map(np.asarray, state.params)
        placed = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
        for _ in range(3):
            state, metrics = step(state, placed, weights)
            logged.append({k: float(v) for k, v in metrics.items() if k == "loss" or k.startswith("distill/")})
        for got, want in zip(jax.tree.leaves(weights), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        results.append((logged, jax.tree.map(np.asarray, state.params), start, before))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for got, want in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[0][1]), strict=True):
        # lr / 20: where Adam's v is ~0 an ulp of summation order moves a weight visibly (seen: 1 of 4,096 by
        # 1.9e-4 after 3 steps); the losses above agree to 1e-5
        np.testing.assert_allclose(got, want, atol=5e-4)

    logged, _, start, teacher_weights = results[0]
    s = jax.jit(one.model.apply)(start, batch["tokens"], batch["positions"], batch["segment_ids"])
    t = jax.jit(one.teacher.model.apply)(teacher_weights, batch["tokens"], batch["positions"], batch["segment_ids"])
    targets, counted = (np.asarray(x) for x in target_weights(batch["tokens"], batch["segment_ids"]))
    log_p = np.asarray(jax.nn.log_softmax(np.asarray(s, np.float64), axis=-1))
    ce = -np.sum(np.take_along_axis(log_p, targets[..., None], -1)[..., 0] * counted) / counted.sum()
    div = float(np.sum(np.asarray(distill.divergence(s, t, 0.5, 2.0)) * counted) / counted.sum())
    first = logged[0]
    assert first["distill/cross_entropy"] == pytest.approx(ce, rel=1e-5)
    assert first["distill/divergence"] == pytest.approx(div, rel=1e-4)
    assert first["loss"] == pytest.approx(0.7 * ce + 0.3 * div, rel=1e-5)
    assert logged[-1]["loss"] < first["loss"]


@pytest.mark.slow  # a stopped and resumed distillation, 16 s (2026-12-06): room for the suite's 10 minutes
def test_a_distilling_run_resumes_exactly_with_the_teacher_it_pinned(teacher_run, tmp_path):
    """With half the steps on the student's own text (distill.on_policy=0.5: the steps drawn from the seed),
    four steps straight equal two, a restart and two more; the run's config.json pins its teacher at the step
    it read (DIR@STEP), and a resume naming another of the teacher's checkpoints is one sentence."""
    from trainer.training.student_samples import StudentSamples

    def run(steps, name, teacher=teacher_run):
        cfg = student(teacher, train=dict(steps=steps, log_every=1), checkpoint={"every_steps": 2})
        cfg.distill.on_policy = 0.5
        return train(cfg, str(tmp_path / name))

    straight = run(4, "straight")
    run(2, "resumed")
    resumed = run(4, "resumed")
    assert resumed["loss"] == straight["loss"]
    with open(tmp_path / "straight" / "metrics.jsonl") as f:
        drawn = [r["distill/on_policy"] for r in map(json.loads, f) if "loss" in r]
    half = types.SimpleNamespace(seed=0, share=0.5)  # the draw of StudentSamples.chosen at on_policy 0.5
    assert drawn == [float(StudentSamples.chosen(half, step)) for step in range(4)] and 0 < sum(drawn) < 4
    with open(tmp_path / "resumed" / "config.json") as f:
        assert json.load(f)["distill"]["teacher"] == f"{teacher_run}@6"
    with pytest.raises(ConfigError, match=r"this run distils from .*@6, pinned at its start"):
        run(6, "resumed", f"{teacher_run}@3")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("missing", r"distill.teacher=.*: .*nowhere does not exist; give a run's workdir"),
        ("empty", r"holds no checkpoint; train the teacher there first"),
        ("vocab", r"reads other tokens \(model.vocab_size=384, .*\) than the student \(model.vocab_size=256"),
        ("dpo", r"distill.teacher with data.format=preference \(DPO's own objective\) is not supported"),
        ("on_policy", r"distill.on_policy=0.5 needs distill.mode=online \(the teacher scores what the student"),
    ],
)
def test_a_teacher_that_cannot_teach_is_one_sentence_before_anything_compiles(teacher_run, tmp_path, change, says):
    teacher = {"missing": str(tmp_path / "nowhere"), "empty": str(tmp_path / "empty")}.get(change, teacher_run)
    if change == "empty":  # a workdir with its config and no checkpoint
        os.makedirs(tmp_path / "empty")
        shutil.copy(os.path.join(teacher_run, "config.json"), tmp_path / "empty" / "config.json")
    cfg = student(teacher, model=dict(vocab_size=256) if change == "vocab" else {})
    if change == "dpo":
        cfg.data.update(format="preference", source="text_files", paths="x.jsonl")
        cfg.checkpoint.init_from = teacher_run
    if change == "on_policy":
        cfg.distill.update(on_policy=0.5, mode="offline")
    with pytest.raises(ConfigError, match=says) as info:
        build(cfg)
    assert "\n" not in str(info.value)


def test_the_planner_counts_the_teachers_weights_and_forward_pass(teacher_run):
    """An online teacher adds its forward pass to the FLOPs per token: 2 x its parameters less the embedding
    table, and its attention (2 matmuls x 2 FLOPs x 4 heads x 24 wide x 32 keys x 3 layers); and to the
    planned memory its weights' shards, which are exactly what the compiled step's arguments grow by."""
    from trainer.planning.plan import plan

    alone, taught = plan(micro_config()), plan(student(teacher_run))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(build(student(teacher_run)).teacher.model.abstract_params))
    attention = 2 * 2 * 4 * 24 * 32 * 3
    assert taught["flops_per_token"] - alone["flops_per_token"] == 2 * (n - 384 * 96) + attention
    grown = taught["compiled_breakdown"]["arguments"] - alone["compiled_breakdown"]["arguments"]
    features = 8 // 8 * 32 * 96 * 4  # a device's rows of the microbatch x seq x the teacher's width, fp32
    assert taught["bytes_per_device"]["teacher"] == grown + features


def test_offline_logits_of_the_whole_vocabulary_train_as_the_teacher_online_and_resume_exactly(teacher_run, tmp_path):
    """scripts/teacher_logits.py's logits with top_k = the vocabulary: a run reading them beside its tokens
    trains as the online teacher teaches (the same losses and weights), two steps, a restart and two more equal
    four straight, and an interrupted writing is finished by writing again (a row deleted is written anew, the
    others kept). Logits made for another top_k or batch are one sentence naming it, and so is the online run's workdir
    resumed offline."""
    from trainer.training.offline_teacher import write_logits

    def config(steps, mode="offline", **changes):
        cfg = student(teacher_run, train=dict(steps=steps, log_every=1, eval_every=2), checkpoint={"every_steps": 2})
        cfg.data.data_dir = str(tmp_path / "data")  # the held-out batches are read without logits
        cfg.distill.update({"mode": mode, "top_k": 384, **changes})
        return cfg

    folder = write_logits(config(4), say=lambda _: None)
    first = os.path.getmtime(os.path.join(folder, "rows", "1.ids.npy"))
    os.remove(os.path.join(folder, "rows", "3.logits.npy"))
    assert write_logits(config(4), say=lambda _: None) == folder
    assert os.path.exists(os.path.join(folder, "rows", "3.logits.npy"))
    assert os.path.getmtime(os.path.join(folder, "rows", "1.ids.npy")) == first
    assert np.load(os.path.join(folder, "rows", "0.ids.npy")).shape == (4, 32, 384)

    online = train(config(4, "online"), str(tmp_path / "online"))
    straight = train(config(4), str(tmp_path / "straight"))
    train(config(2), str(tmp_path / "resumed"))
    resumed = train(config(4), str(tmp_path / "resumed"))
    assert straight["loss"] == pytest.approx(online["loss"], rel=1e-6)
    assert resumed["loss"] == straight["loss"]
    for name in ("distill/divergence", "distill/cross_entropy"):
        assert straight[name] == pytest.approx(online[name], rel=1e-5)

    refusals = [
        (dict(top_k=8, logits_dir=folder), {}, r"made for another distill.top_k \(384 there, 8 here\)"),
        (dict(top_k=8), {}, rf"^the teacher logits at {folder} were made for another distill.top_k \(384 there, 8 "),
        (dict(logits_dir=folder), {"train.seed": 1}, r"made for another corpus or batch \(data.\*, train.seed\)"),
        (dict(logits_dir=str(tmp_path / "none")), {}, r"no teacher logits at .*none; write them first"),
    ]
    for change, other, says in refusals:
        with pytest.raises(ConfigError, match=says):
            train(with_changes(config(4, **change), other), str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    # The online run's workdir resumed offline (the docs' two modes in one workdir): one sentence naming the mode.
    with pytest.raises(
        ConfigError,
        match=r"/online was distilled online \(its config.json's distill.mode\); "
        r"resume it with --config.distill.mode=online, or give this offline run another --workdir\.$",
    ):
        train(config(4), str(tmp_path / "online"))


# ~7 s (Beam's worker processes each start JAX and build the teacher): pytest -m slow
@pytest.mark.slow
def test_the_script_writes_on_beams_workers_what_one_process_writes(teacher_run, tmp_path):
    """scripts/teacher_logits.py --workers 2 (Beam's DirectRunner): every row's ids and logits as written in
    this process, its progress and closing lines, and nothing of Beam's or JAX's logging."""
    pytest.importorskip("apache_beam", reason="the beam extra is not installed: pip install -e '.[beam]'")
    from trainer.training.offline_teacher import write_logits

    cfg = student(teacher_run, train=dict(steps=4), data=dict(data_dir=str(tmp_path / "data")))
    cfg.distill.update(mode="offline", top_k=16)
    here = write_logits(cfg, say=lambda _: None)
    cfg.distill.logits_dir = str(tmp_path / "beam")
    done = subprocess.run([sys.executable, "scripts/teacher_logits.py", *cli_args(cfg), "--workers=2"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0, said[-20:]
    assert said[-2:] == ["teacher logits: 8/8 rows, 0.1 MiB",  # 8 rows x 4 windows x 32 x 16 x 8 bytes
                         f"teacher logits in {tmp_path / 'beam'}: top 16 a token, 128 bytes a token"], said  # fmt: skip
    assert not [line for line in said if "Traceback" in line or "INFO" in line or "WARNING" in line], said[:20]
    for row in range(8):
        ids = (np.load(f"{folder}/rows/{row}.ids.npy") for folder in (tmp_path / "beam", here))
        np.testing.assert_array_equal(*ids)
        np.testing.assert_allclose(np.load(f"{tmp_path}/beam/rows/{row}.logits.npy"),
                                   np.load(f"{here}/rows/{row}.logits.npy"), atol=1e-6)  # fmt: skip


def test_an_on_policy_step_trains_on_the_students_own_continuation_of_its_batch(teacher_run):
    """distill.on_policy (GKD's lmbda): a step drawn for it trains on each row's first half and the student's
    sampled second half: the batch is the data's prefix and what the sampler gives for that step's seed, and
    the logged divergence is the two models' on the sampled tokens (computed apart), with no cross-entropy.
    (Its resume: test_a_distilling_run_resumes_exactly_with_the_teacher_it_pinned.)"""
    from trainer.model.sampling import make_generate
    from trainer.training.student_samples import StudentSamples

    cfg = student(teacher_run)
    cfg.distill.on_policy = 1.0
    setup = build(cfg)
    teacher_weights = resume.load_init_params(teacher_config(cfg), setup.teacher)[0]
    rng = np.random.default_rng(5)
    data = {
        "tokens": rng.integers(3, 384, (8, 32)).astype(np.int32),
        "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
        "segment_ids": np.ones((8, 32), np.int32),
    }
    placed = {k: jax.device_put(v, setup.batch_sharding) for k, v in data.items()}
    state = setup.new_state()
    samples = StudentSamples(setup)
    batch = samples(state.params, placed, 0)
    seed = int(np.random.default_rng([cfg.train.seed, 0, 1]).integers(2**31))
    sampler = make_generate(setup.spec, setup.shard, max_new_tokens=16, temperature=2.0)
    new = sampler(state.params, data["tokens"][:, :16], seed)
    np.testing.assert_array_equal(np.asarray(batch["tokens"]), np.concatenate([data["tokens"][:, :16], new], 1))
    assert np.asarray(batch["sampled"]).sum(1).tolist() == [16] * 8
    start = jax.tree.map(np.asarray, state.params)  # the step donates the state
    _, metrics = setup.train_step()(state, batch, teacher_weights)
    s = jax.jit(setup.model.apply)(start, batch["tokens"])
    t = jax.jit(setup.teacher.model.apply)(teacher_weights, batch["tokens"])
    div = np.asarray(distill.divergence(s, t, 0.5, 2.0))[:, 15:31].mean()  # positions predicting sampled tokens
    assert float(metrics["distill/divergence"]) == pytest.approx(float(div), rel=1e-4)
    assert float(metrics["distill/cross_entropy"]) == 0 and float(metrics["distill/on_policy"]) == 1


def test_a_distilled_runs_loss_is_its_cross_entropy_beside_its_teacher_and_the_student_trained_alone(
    teacher_run, tmp_path
):
    """A distilled run shows its cross-entropy as the loss one compares and its objective apart (console line,
    report), and its done: line puts its held-out loss beside its teacher's on the same batches (eval.py's
    score of the teacher's checkpoint) and beside the same student trained alone in a sibling workdir."""
    from trainer.evaluation.loss import evaluate_checkpoint
    from trainer.evaluation.report import read
    from trainer.run.cli import reached_words
    from trainer.storage.metrics import console_line

    alone_cfg = micro_config(train=dict(steps=2, eval_every=2))
    alone = train(alone_cfg, str(tmp_path / "alone"))
    taught_cfg = student(teacher_run, train=dict(steps=2, eval_every=2))
    taught = train(taught_cfg, str(tmp_path / "taught"))
    teacher = evaluate_checkpoint(teacher_config(taught_cfg), teacher_run, max_batches=2, say=lambda _: None)
    assert taught["eval_loss_teacher"] == pytest.approx(teacher["loss"], rel=1e-6)
    assert taught["eval_loss_alone"] == alone["eval_loss"] and taught["alone"] == str(tmp_path / "alone")
    gain = alone["eval_loss"] - taught["eval_loss"]
    words = reached_words(taught)
    assert words.startswith(
        f"validation loss {taught['eval_loss']:.4f} (the teacher's {teacher['loss']:.4f}; "
        f"trained alone {alone['eval_loss']:.4f} at {tmp_path / 'alone'}: taught, "
        f"{abs(gain):.4f} {'lower' if gain > 0 else 'higher: the teacher did not help'}; "
    )
    assert words.endswith(f"loss {taught['distill/cross_entropy']:.4f} (cross-entropy; objective "
                          f"{taught['loss']:.4f})")  # fmt: skip
    line = console_line(2, 2, 2, {**taught, "mfu": None, "loss_scale": 1.0, "tokens_per_sec": 1.0, "step_time": 1.0})
    assert f"loss {taught['distill/cross_entropy']:.4f} (cross-entropy; objective {taught['loss']:.4f})" in line
    plotted = read(str(tmp_path / "taught"))["train"][-1]
    assert (plotted["loss"], plotted["objective"]) == (taught["distill/cross_entropy"], taught["loss"])


def test_a_rows_logits_stream_to_disk_and_an_interrupted_row_goes_on_from_its_last_whole_batch(tmp_path):
    """teacher_logits.write_row holds one batch of windows at a time: the files grow on disk, and a writing
    killed mid-row (here: its scorer fails on the third batch) is finished by writing again, which scores only
    the batches not yet on disk; the row equals one written straight, the top k of each window's logits."""
    from trainer.data import teacher_logits

    rng, count, seq, k = np.random.default_rng(0), 21, 8, 3
    windows = [{"tokens": rng.integers(0, 50, (1, seq)), "positions": np.arange(seq)[None],
                "segment_ids": np.ones((1, seq), np.int32)} for _ in range(count)]  # fmt: skip
    table = rng.standard_normal((50, 50)).astype(np.float32)  # a "teacher": logits of the next id, by this id
    calls = []

    def score(tokens, positions, segment_ids, fail_at=None):
        calls.append(len(tokens))
        if len(calls) == fail_at:
            raise RuntimeError("killed")
        logits = table[tokens]
        ids = np.argsort(-logits, axis=-1, kind="stable")[..., :k].astype(np.int32)
        return ids, np.take_along_axis(logits, ids, -1)

    for name in ("straight", "resumed"):
        os.makedirs(tmp_path / name / teacher_logits.ROWS)
    teacher_logits.write_row(0, str(tmp_path / "straight"), iter(windows), count, score, batch=4)
    calls.clear()
    with pytest.raises(RuntimeError, match="killed"):
        teacher_logits.write_row(0, str(tmp_path / "resumed"), iter(windows), count,
                                 lambda *a: score(*a, fail_at=3), batch=4)  # fmt: skip
    assert teacher_logits.missing_rows(str(tmp_path / "resumed"), 1) == [0]  # not in place until whole
    calls.clear()
    teacher_logits.write_row(0, str(tmp_path / "resumed"), iter(windows), count, score, batch=4)
    assert calls == [4, 4, 4, 1]  # batches 3-6 of 6: the first two were on disk
    for kind in ("ids", "logits"):
        straight, resumed = (np.load(tmp_path / d / teacher_logits.ROWS / f"0.{kind}.npy") for d in
                             ("straight", "resumed"))  # fmt: skip
        np.testing.assert_array_equal(resumed, straight)
    expected = np.sort(table[np.concatenate([w["tokens"] for w in windows])], axis=-1)[..., ::-1][..., :k]
    np.testing.assert_array_equal(np.load(tmp_path / "straight" / teacher_logits.ROWS / "0.logits.npy"), expected)
    assert sorted(os.listdir(tmp_path / "resumed" / teacher_logits.ROWS)) == ["0.ids.npy", "0.logits.npy"]
