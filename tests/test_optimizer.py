"""Schedules against their closed forms; AdamW's decay mask against the decoupled-decay formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from trainer.errors import ConfigError
from trainer.optim import schedules
from trainer.optim.optimizer import applied_learning_rate, decay_mask, make_optimizer, with_hyperparams
from trainer.optim.schedules import make_schedule

PEAK, FLOOR_RATIO, WARMUP, TOTAL = 1e-3, 0.1, 10, 110
FLOOR = PEAK * FLOOR_RATIO


def optim(**kw):
    c = micro_config().optim
    c.update(dict(lr=PEAK, min_lr_ratio=FLOOR_RATIO, warmup_steps=WARMUP, decay_steps=0), **kw)
    return c


@pytest.mark.parametrize(
    "schedule,step,expected",
    [
        ("cosine", 0, PEAK / WARMUP),
        ("cosine", 4, PEAK * 5 / WARMUP),
        ("cosine", 9, PEAK),
        ("cosine", 10, PEAK),
        ("cosine", 60, FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.5))),
        ("cosine", 85, FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.75))),
        # The last step trained is TOTAL - 1 (the clock counts steps already taken), one
        # step short of the floor: a decay that ends early or late moves this value.
        ("cosine", TOTAL - 1, FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.99))),
        ("linear", 35, PEAK - (PEAK - FLOOR) * 0.25),
        ("linear", TOTAL - 1, PEAK - (PEAK - FLOOR) * 0.99),
        ("constant", 3, PEAK * 4 / WARMUP),
        ("constant", 100, PEAK),
    ],
)
def test_schedule_closed_forms(schedule, step, expected):
    lr = make_schedule(optim(schedule=schedule), TOTAL)
    assert float(lr(step)) == pytest.approx(expected, rel=1e-5)


def test_cosine_with_explicit_decay_steps_holds_the_floor_after():
    lr = make_schedule(optim(schedule="cosine", decay_steps=40), TOTAL)
    assert float(lr(30)) == pytest.approx(FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-5)
    assert float(lr(50)) == pytest.approx(FLOOR, rel=1e-5)
    assert float(lr(100)) == pytest.approx(FLOOR, rel=1e-5)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_wsd_warms_holds_then_decays_over_the_last_fraction(shape):
    lr = make_schedule(optim(schedule="wsd", decay_fraction=0.2, decay_shape=shape), 100)
    # decay occupies steps 80..100
    assert float(lr(4)) == pytest.approx(PEAK / 2, rel=1e-5)
    assert float(lr(50)) == pytest.approx(PEAK, rel=1e-6)
    assert float(lr(79)) == pytest.approx(PEAK, rel=1e-6)
    half = (
        PEAK - (PEAK - FLOOR) * 0.5 if shape == "linear" else FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi / 2))
    )
    assert float(lr(90)) == pytest.approx(half, rel=1e-5)
    quarter = (
        PEAK - (PEAK - FLOOR) * 0.25
        if shape == "linear"
        else FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi / 4))
    )
    assert float(lr(85)) == pytest.approx(quarter, rel=1e-5)
    last = (  # step 99, the last trained
        PEAK - (PEAK - FLOOR) * 0.95
        if shape == "linear"
        else FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.95))
    )
    assert float(lr(99)) == pytest.approx(last, rel=1e-5)


def test_wsd_refuses_a_decay_that_starts_inside_warmup():
    with pytest.raises(ConfigError, match="before warmup ends"):
        schedules.check(optim(schedule="wsd", warmup_steps=90, decay_fraction=0.2), 100)


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
