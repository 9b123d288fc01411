"""Schedules against their closed forms; AdamW's decay mask against the decoupled-decay formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from trainer.config.errors import ConfigError
from trainer.optim import schedules
from trainer.optim.optimizer import applied_learning_rate, decay_mask, make_optimizer, with_hyperparams
from trainer.optim.schedules import make_schedule

PEAK, FLOOR_RATIO, WARMUP, TOTAL = 1e-3, 0.1, 10, 110
FLOOR = PEAK * FLOOR_RATIO


def optim(**kw):
    c = micro_config().optim
    c.update(dict(lr=PEAK, min_lr_ratio=FLOOR_RATIO, warmup_steps=WARMUP, decay_steps=0), **kw)
    return c


def reference(schedule, total, warmup, decay=0, shape="linear", peak=PEAK, floor=FLOOR):
    """Every update's rate, step by step: warmup's k-th update (k = 1..warmup) at peak k / warmup; a decay of
    n updates, its k-th (k = 1..n) at fraction k / n of the way from the peak to the floor, so the n-th is the
    floor; the peak between; the floor after. Written from the definitions, not from schedules.py."""
    shape = shape if schedule == "wsd" else schedule
    n = decay or total - warmup
    first = total - n if schedule == "wsd" else warmup  # the decay's first update
    rates = []
    for step in range(total):
        if step < warmup:
            rates.append(peak * (step + 1) / warmup)
        elif schedule == "constant" or step < first:
            rates.append(peak)
        elif step >= first + n:
            rates.append(floor)
        else:
            f = (step - first + 1) / n
            cosine = floor + (peak - floor) * (1 + math.cos(math.pi * f)) / 2
            rates.append(peak - (peak - floor) * f if shape == "linear" else cosine)
    return rates


CASES = [  # (schedule, train.steps, warmup, decay steps: cosine/linear's decay_steps, WSD's steps from its fraction)
    ("cosine", 110, 10, 0), ("cosine", 110, 10, 40), ("cosine", 7, 2, 0), ("cosine", 5, 3, 2),
    ("linear", 1000, 0, 0), ("linear", 12, 3, 3), ("constant", 20, 4, 0),
    ("wsd", 100, 10, 20), ("wsd", 1000, 0, 4), ("wsd", 9, 2, 3), ("wsd", 10, 1, 2), ("wsd", 3, 0, 2),
]  # fmt: skip


@pytest.mark.parametrize(
    "schedule,total,warmup,decay,shape",
    [(*case, "linear") for case in CASES] + [(*case, "cosine") for case in CASES if case[0] == "wsd"],
)
def test_every_update_of_every_schedule_against_its_closed_form(schedule, total, warmup, decay, shape):
    kw = dict(decay_fraction=decay / total, decay_shape=shape) if schedule == "wsd" else dict(decay_steps=decay)
    cfg = optim(schedule=schedule, warmup_steps=warmup, **kw)
    schedules.check(cfg, total)
    lr = make_schedule(cfg, total)
    got = [float(lr(s)) for s in range(total)]
    np.testing.assert_allclose(got, reference(schedule, total, warmup, decay, shape), rtol=1e-5)
    if schedule != "constant":
        assert got[-1] == pytest.approx(FLOOR, rel=1e-6)  # the last update is the floor ...
        first = total - decay if schedule == "wsd" else warmup
        assert got[first] < PEAK * (1 - 1e-6)  # ... and the decay's first is below the peak


def test_a_four_step_wsd_cooldown_of_a_thousand_step_run_ends_at_zero():
    """The example from the report: lr 1, floor 0, decay_fraction 0.004: the last four updates."""
    lr = make_schedule(optim(schedule="wsd", lr=1.0, min_lr_ratio=0.0, warmup_steps=0, decay_fraction=0.004), 1000)
    assert [float(lr(s)) for s in range(995, 1000)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-7)


def test_wsd_refuses_a_decay_shorter_than_two_steps():
    with pytest.raises(ConfigError, match=r"optim.decay_fraction=0.001 of train.steps=1000 gives a WSD decay of 1 "
                                          r"step, too short to cool down; raise optim.decay_fraction to at least "
                                          r"0.002"):  # fmt: skip
        schedules.check(optim(schedule="wsd", decay_fraction=0.001, warmup_steps=0), 1000)


def test_wsd_refuses_a_decay_that_starts_inside_warmup():
    with pytest.raises(ConfigError, match="before warmup ends"):
        schedules.check(optim(schedule="wsd", warmup_steps=90, decay_fraction=0.2), 100)


def test_the_logged_rate_is_the_one_each_update_used_across_a_resume_mid_decay(tmp_path, capsys):
    """A 9-step WSD run with a 3-step cooldown, stopped at step 7 (inside it) and resumed: the rate logged
    with step k is the closed form's for update k - 1, before and after the resume, down to the floor. Its
    optim.decay_steps, which WSD never reads, is named in a warning at each start."""
    import json
    import os
    import shutil

    from trainer.run.loop import train

    cfg = micro_config(
        optim=dict(schedule="wsd", lr=PEAK, min_lr_ratio=FLOOR_RATIO, warmup_steps=2, decay_fraction=3 / 9,
                   decay_steps=4),
        train=dict(steps=9, log_every=1), checkpoint={"every_steps": 7, "keep": 5, "async": False},
    )  # fmt: skip
    workdir = str(tmp_path / "run")
    train(cfg, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "9"))  # as if stopped after step 7's checkpoint
    assert train(cfg, workdir)["step"] == 9
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    expected = reference("wsd", 9, 2, 3)
    assert sorted(logged) == list(range(1, 10))
    assert [logged[k] for k in range(1, 10)] == pytest.approx(expected, rel=1e-6)
    assert logged[9] == pytest.approx(FLOOR, rel=1e-6)
    warning = ("warning: optim.decay_steps=4 is read only when optim.schedule is cosine or linear; with "
               "optim.schedule=wsd it does nothing.")  # fmt: skip
    said = capsys.readouterr().out.splitlines()
    assert said.count(warning) == 2
    assert said.count("running on the CPU (8 devices): no GPU or TPU is in use") == 2  # once per launch


def test_decay_mask_follows_the_logical_axes_of_the_real_model():
    """Decay on every matrix (embedding, projections, head), never on a norm's gain, whatever it is named."""
    from trainer.model.decoder import NO_SHARDING, ModelDef
    from trainer.model.spec import ModelSpec

    model = ModelDef.create(ModelSpec.from_config(micro_config(model=dict(tie_embeddings=False))), NO_SHARDING)
    mask = decay_mask(model.logical_names)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    shapes = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(model.abstract_params)}
    assert flat.keys() == shapes.keys()
    for name, decayed in flat.items():
        # Independent of the axis names: a stacked weight's own rank is its rank less the layer axis.
        rank = len(shapes[name]) - (name.startswith("['layers']"))
        assert decayed == (rank >= 2), name
    assert any(flat.values()) and not all(flat.values())


def test_first_update_is_pure_decoupled_decay_on_weights_and_none_on_scales():
    """With zero gradients Adam's step is 0, so AdamW moves p to p * (1 - lr * wd) exactly where decay applies."""
    cfg = micro_config(optim=dict(weight_decay=0.1, clip_norm=0.0))
    tx = make_optimizer(cfg, {"w": ("embed", "mlp"), "norm": {"scale": ("embed",)}})
    params = {"w": jnp.full((3, 2), 2.0), "norm": {"scale": jnp.full((3,), 2.0)}}
    state = with_hyperparams(tx.init(params), learning_rate=jnp.float32(0.5))
    updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
    np.testing.assert_allclose(np.asarray(params["w"] + updates["w"]), 2.0 * (1 - 0.5 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(updates["norm"]["scale"]), 0.0)
    assert float(applied_learning_rate(state)) == pytest.approx(0.5)


def test_clipping_bounds_the_update_by_the_global_norm():
    """A huge gradient and a small one give the same first Adam step (Adam normalises), but
    the clipped gradient enters the moments: mu after one step is 0.1 * clipped gradient."""
    cfg = micro_config(optim=dict(clip_norm=1.0, weight_decay=0.0, b1=0.9))
    tx = make_optimizer(cfg, {"w": ("embed",)})
    params = {"w": jnp.zeros((4,))}
    state = with_hyperparams(tx.init(params), learning_rate=jnp.float32(1e-3))
    grad = {"w": jnp.array([300.0, 400.0, 0.0, 0.0])}  # norm 500
    _, state = tx.update(grad, state, params)
    mu = state[1].inner_state[0].mu["w"]
    np.testing.assert_allclose(np.asarray(mu), 0.1 * np.array([0.6, 0.8, 0.0, 0.0]), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_the_train_on_hint_says_when_a_schedule_would_rewarm_and_how_not_to(schedule):
    """A finished run's 'train on' hint (trainer/run/cli.py): twice the steps stretches a schedule that decays to
    the end, so the rate rises again, which the hint says; its second command goes on from the rate the run
    ended with, never above it, and changes none of the steps already taken. A constant schedule: one
    command, nothing to say."""
    from trainer.config.forms import with_changes
    from trainer.run.cli import train_on

    cfg = with_changes(micro_config(), {"train.steps": 300, "optim.schedule": schedule, "optim.warmup_steps": 20,
                                        "optim.lr": 4e-3})  # fmt: skip
    said = train_on(cfg)
    ran = make_schedule(cfg.optim, 300)
    ended = float(ran(299))
    if schedule == "constant":
        assert said == [("train on, to twice the steps", ["--config.train.steps=600"])]
        return
    (stretched, longer), (held, flags) = said
    assert longer == ["--config.train.steps=600"] and flags[0] == "--config.train.steps=600"
    again = float(make_schedule(with_changes(cfg, {"train.steps": 600}).optim, 600)(300))
    assert again > ended and f"rises again, from {ended:.2e} to {again:.2e}" in stretched
    assert f"{ended:.2e}, without re-warming" in held
    changes = {"train.steps": 600}
    for flag in flags[1:]:
        key, value = flag.removeprefix("--config.").split("=")
        changes[key] = type(defaults_of(key))(value)
    going_on = make_schedule(with_changes(cfg, changes).optim, 600)
    rates = np.array([float(going_on(s)) for s in range(600)])
    if schedule != "wsd":  # the same curve to the run's end (wsd's is held at its floor from there on)
        np.testing.assert_allclose(rates[:300], [float(ran(s)) for s in range(300)], rtol=1e-6)
    assert rates[300:].max() <= ended * (1 + 1e-6)


def defaults_of(key: str):
    from trainer.config import defaults
    from trainer.config.forms import flatten

    return flatten(defaults())[key]
