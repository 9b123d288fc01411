"""The optimiser family against closed forms, and each of them learning."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import cli_args, micro_config

from trainer.config.errors import ConfigError
from trainer.objectives.language_model import chunked_loss_sums, target_weights
from trainer.optim.optimizer import make_optimizer, with_hyperparams
from trainer.planning import experiments
from trainer.training.setup import build

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = {"w": ("layers", "embed", "mlp"), "norm": {"scale": ("layers", "embed")}}


def one_update(name, grads_seq, lr=0.1, wd=0.01, **optim):
    cfg = micro_config(optim=dict(name=name, clip_norm=0.0, weight_decay=wd, **optim))
    tx = make_optimizer(cfg, NAMES)
    params = {"w": jnp.full((1, 2, 3), 0.5), "norm": {"scale": jnp.ones((1, 2))}}
    state = tx.init(params)
    history = [params]
    for g in grads_seq:
        updates, state = tx.update(g, with_hyperparams(state, learning_rate=jnp.float32(lr)), params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        history.append(params)
    return history


def grads(value):
    return {"w": jnp.full((1, 2, 3), value), "norm": {"scale": jnp.full((1, 2), value)}}


def test_sgd_momentum_matches_its_closed_form():
    lr, wd, mu = 0.1, 0.01, 0.9
    h = one_update("sgd", [grads(1.0), grads(-2.0)], lr=lr, wd=wd, momentum=mu)
    p0 = 0.5
    m1 = 1.0
    p1 = p0 - lr * (m1 + wd * p0)  # decoupled decay, after the momentum
    m2 = -2.0 + mu * m1
    p2 = p1 - lr * (m2 + wd * p1)
    np.testing.assert_allclose(np.asarray(h[2]["w"]), p2, rtol=1e-6)
    assert float(h[2]["norm"]["scale"][0, 0]) == pytest.approx(1 - lr * 1.0 - lr * (-2.0 + mu))  # no decay on scales


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "sgd", "muon"])
def test_weight_decay_is_decoupled_and_scaled_by_the_learning_rate(name):
    """With a zero gradient every optimiser moves decayed weights by exactly -lr x wd x w and
    leaves norms alone. (optax.adafactor's own weight_decay_rate skips the lr: 10% per step at 0.1.)"""
    before, after = one_update(name, [grads(0.0)], lr=0.1, wd=0.01)
    np.testing.assert_allclose(after["w"], before["w"] * (1 - 0.1 * 0.01), rtol=1e-6)
    np.testing.assert_array_equal(after["norm"]["scale"], before["norm"]["scale"])


def test_lion_takes_signed_steps():
    lr, wd = 0.1, 0.01
    h = one_update("lion", [grads(0.003)], lr=lr, wd=wd)
    np.testing.assert_allclose(np.asarray(h[1]["w"]), 0.5 - lr * (1.0 + wd * 0.5), rtol=1e-6)


def test_muon_orthogonalises_weight_matrix_updates_and_adams_the_rest():
    cfg = micro_config(optim=dict(name="muon", lr=0.02, clip_norm=0.0, weight_decay=0.0))
    setup = build(cfg, jax.devices()[:1])
    params = setup.new_state().params
    rng = np.random.default_rng(0)
    g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    state = setup.tx.init(params)
    updates, _ = setup.tx.update(g, with_hyperparams(state, learning_rate=jnp.float32(0.02)), params)

    def spread(m):
        s = np.linalg.svd(np.asarray(m), compute_uv=False)
        return s.max() / s.min()

    for layer in range(cfg.model.n_layers):
        # A Gaussian 64 x 128 gradient spreads its singular values ~5.8x; Muon's five Newton-Schulz
        # steps pull them into ~[0.7, 1.1] (measured spread 1.66) for every layer of the stack.
        assert spread(g["layers"]["mlp"]["w_up"][layer]) > 4
        assert spread(updates["layers"]["mlp"]["w_up"][layer]) < 2
    # The embedding goes to AdamW, whose first step is lr * sign(g): one magnitude everywhere.
    magnitudes = np.abs(np.asarray(updates["embed"]))
    np.testing.assert_allclose(magnitudes, magnitudes.mean(), rtol=1e-3)  # eps shows where |g| is tiny


@pytest.mark.parametrize(
    "name,lr", [("adamw", 1e-2), ("lion", 3e-3), ("adafactor", 1e-2), ("sgd", 0.3), ("muon", 1e-2)]
)
def test_every_optimiser_learns(name, lr, corpus_dir):
    cfg = micro_config(
        data=dict(source="text_files", data_dir=corpus_dir),
        optim=dict(name=name, lr=lr, warmup_steps=2),
        train=dict(steps=25),
    )
    losses = experiments.loss_curve(cfg, experiments.fixed_batches(cfg, 25))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses


def test_z_loss_is_the_mean_square_log_normaliser():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7)) * 3
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 7)
    _, count, log_z_sq, _ = chunked_loss_sums(lambda x: x, logits, *target_weights(tokens, None), chunk=0)
    z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))[:, :-1]  # positions with a target
    assert float(log_z_sq) == pytest.approx((z**2).sum(), rel=1e-5) and float(count) == 8


def test_an_unknown_optimiser_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="optim.name='adam' is not one of adamw, lion, adafactor, sgd, muon"):
        build(micro_config(optim=dict(name="adam")))


def test_compare_optimizers_writes_a_plot_and_a_table(tmp_path):
    cfg = micro_config(data=dict(source="synthetic"))
    result = subprocess.run(
        [sys.executable, "scripts/compare_optimizers.py", *cli_args(cfg), "--steps=3", f"--out={tmp_path}",
         "--optimizers=adamw,lion"], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "optimizers.md").read_text()
    assert "| adamw |" in table and "| lion |" in table
    assert (tmp_path / "optimizers.png").stat().st_size > 10_000
