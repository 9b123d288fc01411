"""Mixture of experts (model.moe, mesh.expert): the layer against every expert run on every token, the
expert axis against one device, and a run that trains, resumes onto another expert axis and decodes."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HYBRID, REPO, micro_config
from test_context import packed_batch

from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding
from trainer.config.errors import ConfigError
from trainer.interop.families import to_hf_tensors
from trainer.model import moe
from trainer.model.sampling import make_generate
from trainer.model.spec import Execution
from trainer.run.loop import train
from trainer.storage.checkpoint import Checkpointer
from trainer.training.setup import build
from trainer.training.state import abstract_params

EXPERTS = dict(num_experts=8, experts_per_token=2, d_ff=32, shared_experts=1, dense_layers=1)


def every_expert(x, chosen, weights, gate, up, down, kept=None):
    """The reference: each expert on every token, summed with the router's weights where it was chosen (and
    `kept`, when a capacity dropped some)."""
    hidden = jax.nn.silu(jnp.einsum("btd,edf->btef", x, gate)) * jnp.einsum("btd,edf->btef", x, up)
    y = jnp.einsum("btef,efd->bted", hidden, down)
    use = weights if kept is None else weights * kept
    return jnp.einsum("bted,bte->btd", y, jnp.sum(jax.nn.one_hot(chosen, gate.shape[0]) * use[..., None], axis=2))


def sharding(mesh: dict) -> LogicalSharding:
    """The rules on 8 devices with these axis sizes, data the rest."""
    return LogicalSharding.create(make_mesh(micro_config(mesh={"fsdp": 1, "data": -1, **mesh}).mesh))


def test_the_layer_equals_every_expert_on_every_token_and_a_capacity_drops_the_latest():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    b, t, d, f, e, k = 8, 16, 16, 12, 4, 2
    x = jax.random.normal(keys[0], (b, t, d))
    shapes = [(e, d, f), (e, d, f), (e, f, d)]
    gate, up, down = (0.3 * jax.random.normal(key, shape) for key, shape in zip(keys[2:], shapes, strict=True))
    chosen, weights, stats = moe.route(x, jax.random.normal(keys[1], (d, e)), jnp.zeros(e), k)
    assert np.allclose(jnp.sum(weights, -1), 1) and np.isclose(jnp.sum(stats["load"]), 1)
    none = LogicalSharding.create(None)
    out, dropped = moe.experts(x, chosen, weights, gate, up, down, none, Execution(capacity_factor=1.0))
    np.testing.assert_allclose(out, every_expert(x, chosen, weights, gate, up, down), atol=1e-5)
    assert float(dropped) == 0
    # On one device and split over meshes, through megablox's kernel (Pallas' interpreter here) and ragged_dot:
    # the outputs and the gradients of x and every weight of ragged_dot on one device. Over a mesh the tokens
    # cross the expert axis by all-to-all, d_ff's partial sums are added over tensor, and megablox runs under
    # shard_map unchecked (check_vma=False): these gradients are that path's check.
    cotangent = jax.random.normal(keys[1], x.shape)

    def grads(kind, mesh=None):
        shard = none if mesh is None else sharding(mesh)
        run = Execution(grouped_matmul=kind)
        pull = lambda *w: jnp.sum(cotangent * moe.experts(w[0], chosen, weights, *w[1:], shard, run)[0])  # noqa: E731
        return jax.jit(jax.value_and_grad(pull, argnums=(0, 1, 2, 3)))(x, gate, up, down)

    value, grad = grads("ragged_dot")
    for kind, mesh in (("megablox", None), ("megablox", {"expert": 2, "fsdp": 2, "tensor": 2}),
                       ("ragged_dot", {"expert": 4, "fsdp": 2})):  # fmt: skip
        other_value, other_grad = grads(kind, mesh)
        assert float(other_value) == pytest.approx(float(value), rel=1e-5), (kind, mesh)
        for ours, theirs in zip(other_grad, grad, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=1e-5 * float(np.abs(theirs).max()), err_msg=f"{kind} {mesh}")
    assert moe.grouped_matmul("auto", "cpu") is jax.lax.ragged_dot  # megablox is auto's on a TPU alone
    assert moe.grouped_matmul("auto", "tpu").__name__ == "megablox"
    # Rows past the groups (a device's empty slots in the exchange): zeros, and no gradient, as ragged_dot's
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)
    for kind in ("megablox", "ragged_dot"):
        matmul = moe.grouped_matmul(kind, "cpu")
        squares = jax.jit(jax.grad(lambda v, f=matmul: jnp.sum(f(v, gate, sizes) ** 2)))
        rows, grad = jax.jit(matmul)(x[0], gate, sizes), squares(x[0])
        assert not np.any(rows[10:]) and not np.any(grad[10:]) and np.all(np.isfinite(grad)), kind
    # A capacity of 1.0 x an even share (16 slots an expert for 64 assignments over 4 experts): first choices
    # take their places first, then second choices, each in token order; the rest are dropped.
    flat = np.asarray(chosen).reshape(-1, k)
    room = math.ceil(flat.size / e)
    kept, used = np.zeros(flat.shape, bool), np.zeros(e, int)
    for j in range(k):
        for i in range(len(flat)):
            kept[i, j], used[flat[i, j]] = used[flat[i, j]] < room, used[flat[i, j]] + (used[flat[i, j]] < room)
    assert 0 < (~kept).sum() < flat.size / 4  # some dropped, by the imbalance of a random router
    capacity = Execution(moe_impl="capacity", capacity_factor=1.0)
    out, dropped = moe.experts(x, chosen, weights, gate, up, down, none, capacity)
    reference = every_expert(x, chosen, weights, gate, up, down, kept.reshape(b, t, k))
    np.testing.assert_allclose(out, reference, atol=1e-5)
    assert float(dropped) == pytest.approx((~kept).mean())


def loss_grads(mesh: dict, batch: dict, params=None, impl="dropless", capacity_factor=1.25, model=None):
    """(loss with both auxiliary losses, gradients, statistics, the compiled text, parameters) of a micro
    model with EXPERTS (or `model`'s model.*) on `mesh`."""
    model = model or dict(n_layers=3, moe={**EXPERTS, "impl": impl, "capacity_factor": capacity_factor})
    setup = build(micro_config(mesh={"fsdp": 1, "data": -1, **mesh}, model=model))
    params = setup.new_state().params if params is None else jax.device_put(params, setup.state_shardings.params)

    def loss(p, b):
        ce, count, _, _, stats = setup.model.apply(p, b["tokens"], b["positions"], b["segment_ids"],
                                                   method="loss_sums")  # fmt: skip
        return ce / count + 0.01 * jnp.sum(stats["balance_loss"]) + 1e-3 * jnp.sum(stats["router_z"]), stats

    batch = jax.device_put(batch, setup.batch_sharding)
    step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, batch).compile()
    (value, stats), grads = step(params, batch)
    return float(value), jax.device_get(grads), jax.device_get(stats), step.as_text(), jax.device_get(params)


def test_experts_split_over_the_expert_axis_equal_one_device():
    """The whole model: dropless at expert 2 x fsdp 2 x tensor 2 (the layer alone is also checked at expert
    4 x fsdp 2, and through megablox, above); a capacity with room for every assignment at expert 4: the
    loss (with both auxiliary losses), every gradient and the load of one device, within fp32 rounding. The
    tokens cross the axis by all-to-all."""
    batch = packed_batch()
    loss, grads, stats, _, params = loss_grads({}, batch)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    cases = [({"expert": 2, "fsdp": 2, "tensor": 2}, "dropless", 1.25), ({"expert": 4}, "capacity", 4.0)]
    for mesh, impl, factor in cases:
        other, other_grads, other_stats, hlo, _ = loss_grads(mesh, batch, params, impl, factor)
        assert other == pytest.approx(loss, rel=1e-6), (mesh, impl)
        for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5 * scale, err_msg=f"{mesh} {impl}")
        np.testing.assert_allclose(other_stats["load"], stats["load"], atol=1e-6)
        assert float(np.max(other_stats["dropped"])) == 0
        assert " all-to-all" in hlo, mesh  # there and back, forward and backward
    # Room for one even share: a device's 32 tokens x 2 choices over 8 experts give each 8 places, and a
    # random router's imbalance overfills some.
    _, _, dropped, _, _ = loss_grads({"expert": 4}, batch, params, "capacity", 1.0)
    assert 0 < float(np.max(dropped["dropped"])) < 0.5


def test_a_hybrid_with_experts_in_every_layer_splits_over_the_expert_axis_as_one_device():
    """Qwen3.5-MoE's shape: a Gated DeltaNet layer and a full-attention one, each with routed experts and a
    shared expert behind its sigmoid gate. At expert 2 x fsdp 2 x tensor 2: the loss, every gradient and
    each layer's load (in the model's layer order, both stacks) of one device, within fp32 rounding."""
    model = {**HYBRID, "moe": dict(num_experts=4, experts_per_token=2, d_ff=32, shared_experts=1, shared_gate=True)}
    batch = packed_batch()
    loss, grads, stats, _, params = loss_grads({}, batch, model=model)
    assert stats["load"].shape == (2, 4) and np.allclose(stats["load"].sum(axis=1), 1)
    assert float(np.abs(grads["linear_layers"]["moe"]["w_shared_gate"]).max()) > 0
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    other, other_grads, other_stats, hlo, _ = loss_grads({"expert": 2, "fsdp": 2, "tensor": 2}, batch, params,
                                                         model=model)  # fmt: skip
    assert other == pytest.approx(loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)
    np.testing.assert_allclose(other_stats["load"], stats["load"], atol=1e-6)
    assert " all-to-all" in hlo


@pytest.mark.xla_defaults
def test_a_run_with_experts_trains_resumes_onto_another_expert_axis_and_decodes(tmp_path):
    """Two steps at expert 4 x fsdp 2, two more at expert 2 x tensor 2, with DeepSeek's router bias moving:
    the losses and weights of a run on one device within fp32 rounding; the log carries each layer's load
    and the auxiliary losses; the checkpoint decodes the same greedy text on expert 4 and on one device, and
    its moved router bias is refused an export."""

    def config(steps, **mesh):
        cfg = micro_config(train=dict(steps=steps, log_every=1, eval_every=0), mesh={"fsdp": 1, "data": -1, **mesh},
                           model=dict(n_layers=3, moe={**EXPERTS, "router_bias": 1e-3}))  # fmt: skip
        cfg.optim.update(schedule="constant", warmup_steps=1)
        cfg.checkpoint.update(every_steps=2, keep=5)
        return cfg

    reference = train(config(4), str(tmp_path / "one"))
    train(config(2, expert=4, fsdp=2), str(tmp_path / "split"))
    resumed = train(config(4, expert=2, tensor=2), str(tmp_path / "split"))
    assert resumed["step"] == 4
    assert resumed["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    weights, one = [], build(config(4))
    for run in ("one", "split"):
        ckpt = Checkpointer(str(tmp_path / run / "checkpoints"), read_only=True)
        weights.append(ckpt.restore_params(4, abstract_params(one.model, one.shard)))
        ckpt.close()
    # Weights to lr / 1000 at XLA's defaults, as users compile (at -O0 one of 8192 is 2.3e-5 off: xla_defaults).
    for a, b in zip(jax.tree.leaves(weights[0]), jax.tree.leaves(weights[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    bias = weights[1]["layers"]["moe"]["router_bias"]  # (2 MoE layers, 8 experts): 4 steps of +-1e-3 each
    assert np.all(np.abs(bias) <= 4e-3 + 1e-9) and np.any(bias != 0)
    # ... each step's towards the even load: 1e-3 x sign(mean share - share), from the shares the run logged
    with open(tmp_path / "one" / "metrics.jsonl") as f:
        logged = {r["step"]: r for r in map(json.loads, f) if "loss" in r}
    shares = np.array([[[logged[s][f"moe/load/{i}/{e}"] for e in range(8)] for i in range(2)] for s in range(1, 5)])
    np.testing.assert_allclose(weights[0]["layers"]["moe"]["router_bias"], 1e-3 * np.sign(1 / 8 - shares).sum(0),
                               atol=1e-9)  # fmt: skip
    with pytest.raises(ConfigError, match=r"layer 1's router bias \(model.moe.router_bias\) is not zero"):
        to_hf_tensors(weights[1], one.spec.arch)  # a moved bias has no place in Hugging Face's forms
    with open(tmp_path / "split" / "metrics.jsonl") as f:
        last = [r for r in map(json.loads, f) if "loss" in r][-1]
    shares = [[last[f"moe/load/{i}/{e}"] for e in range(8)] for i in range(2)]
    assert np.allclose(np.sum(shares, axis=1), 1)
    assert last["moe/load_max_mean/1"] == pytest.approx(8 * max(shares[1]))
    assert last["moe/balance_loss"] > 0 and last["moe/router_z"] > 0 and last["moe/dropped"] == 0

    prompt = np.random.default_rng(1).integers(3, 384, (2, 5)).astype(np.int32)
    texts = []
    for setup in (build(config(4, expert=4, fsdp=2)), one):
        params = jax.device_put(weights[1], setup.state_shardings.params)
        texts.append(np.asarray(make_generate(setup.spec, setup.shard, max_new_tokens=6)(params, prompt, 0)))
    np.testing.assert_array_equal(texts[0], texts[1])
    assert os.path.isdir(tmp_path / "split" / "checkpoints" / "4")


# ~2 minutes on two cores (pytest -m slow); the exactness and resume above run in CI
@pytest.mark.slow
def test_moe_tiny_learns_through_the_script_on_an_expert_axis(tmp_path, corpus_dir):
    """configs/moe_tiny.py through scripts/train.py with its experts split over 4 devices (fsdp 2), 40 steps
    of 8 x 256 bytes: its training loss falls well below the unigram's (measured: 2.68 against 3.32; the
    validation loss lags, 3.29 at step 40, and the full 450 steps reach 1.87, README), no layer's load
    collapses onto two experts (the most loaded at most 4x the mean share; measured 2.4-2.5) and nothing is
    dropped."""
    workdir = str(tmp_path / "run")
    args = ["--config", "configs/moe_tiny.py", f"--config.data.data_dir={corpus_dir}", "--config.train.steps=40",
            "--config.train.global_batch_size=8", "--config.optim.warmup_steps=5", "--config.train.eval_every=40",
            "--config.train.log_every=5", "--config.mesh.expert=4", "--config.mesh.fsdp=2",
            f"--workdir={workdir}"]  # fmt: skip
    run = subprocess.run([sys.executable, "scripts/train.py", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    (evaluation,) = [r for r in records if "eval_loss" in r]
    last = [r for r in records if "loss" in r][-1]
    assert last["loss"] < evaluation["unigram_loss"] - 0.5, (last["loss"], evaluation)
    assert max(last[f"moe/load_max_mean/{i}"] for i in range(4)) < 4 and last["moe/dropped"] == 0


def test_an_export_with_no_hugging_face_form_is_one_sentence():
    """Shared experts, and Mixtral's form with dense layers, have no transformers class here: refused by name
    (a moved router bias's refusal is in the run above)."""
    from trainer.interop.families import hf_config
    from trainer.model.spec import Architecture, Experts

    base = dict(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    with pytest.raises(ConfigError, match=r"model.moe.shared_experts=1: MixtralForCausalLM has no shared experts"):
        hf_config(Architecture(**base, moe=Experts(num_experts=4, shared_experts=1)), 64)
    with pytest.raises(ConfigError, match=r"model.moe.dense_layers=1, every=1: every Mixtral layer has experts"):
        hf_config(Architecture(**base, moe=Experts(num_experts=4, dense_layers=1)), 64)
    with pytest.raises(ConfigError, match=r"dense_layers=1 is not a multiple of every=2"):
        interleaved = Experts(num_experts=4, dense_layers=1, every=2)
        hf_config(Architecture(**{**base, "n_layers": 3}, qk_norm=True, moe=interleaved), 64)
    assert hf_config(Architecture(**base, qk_norm=True, moe=Experts(num_experts=4)), 64)["model_type"] == "qwen3_moe"


def test_a_capacity_model_scores_and_writes_each_request_as_if_alone():
    """model.moe.impl=capacity with room for half an even share, which drops assignments in training: a
    request scored alone and batched behind longer ones (and their padding) gets the same log-likelihood, and
    a prompt decoded beside others the same greedy tokens: outside training no token loses its experts to
    another's, and padding is routed nowhere."""
    from trainer.interop.scoring import Scorer

    cfg = micro_config(model=dict(n_layers=2, moe={**EXPERTS, "dense_layers": 0, "impl": "capacity",
                                                   "capacity_factor": 0.5}))  # fmt: skip
    setup = build(cfg)
    params = setup.new_state().params
    rng = np.random.default_rng(3)
    request = ([int(t) for t in rng.integers(3, 384, 6)], [int(t) for t in rng.integers(3, 384, 4)])
    longer = [([int(t) for t in rng.integers(3, 384, 20)], [int(t) for t in rng.integers(3, 384, 9)]) for _ in range(7)]
    scorer = Scorer(setup)
    alone = scorer.loglikelihoods(params, [request])[0]
    batched = scorer.loglikelihoods(params, [*longer, request])[-1]
    assert batched[0] == pytest.approx(alone[0], rel=1e-6, abs=1e-6) and batched[1] == alone[1]
    prompts = [request[0], *(c for c, _ in longer[:5])]
    greedy_alone = scorer.greedy(params, [request[0]], 5)[0]
    np.testing.assert_array_equal(scorer.greedy(params, prompts, 5)[0], greedy_alone)
