"""Reading collectives out of compiled HLO, checked on programs whose communication is known."""

import jax
import jax.numpy as jnp
import pytest
from conftest import micro_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from parallelism import collectives
from trainer.planning.plan import plan


def compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_counts_multiply_by_loop_trips_and_bytes_follow_the_shapes():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))

    def body(_, a):
        gathered = jax.lax.all_gather(a, "x", tiled=True)  # (64,) f32 result
        scattered = jax.lax.psum_scatter(gathered, "x", tiled=True)  # (8,) result
        return scattered + jax.lax.psum(jnp.sum(a), "x")  # f32[] all-reduce

    @jax.shard_map(mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    def step(a):
        return jax.lax.fori_loop(0, 5, body, a)

    x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("x")))
    found = collectives.parse(compiled_text(step, x))
    assert found["all-gather"]["count"] == 5 and found["all-gather"]["bytes"] == 5 * 64 * 4
    assert found["all-gather"]["sent"] == pytest.approx(5 * 7 / 8 * 64 * 4)
    assert found["reduce-scatter"]["count"] == 5 and found["reduce-scatter"]["bytes"] == 5 * 8 * 4
    assert found["reduce-scatter"]["sent"] == pytest.approx(5 * 7 * 8 * 4)
    assert found["all-reduce"]["count"] == 5 and found["all-reduce"]["bytes"] == 5 * 4


def test_a_single_device_step_communicates_nothing():
    result = plan(micro_config(mesh=dict(fsdp=1)), devices=jax.devices()[:1], sharding=True)
    assert result["collectives"]["measured"] == {} and result["collectives"]["textbook"] == {}


def test_fsdp_gathers_every_weight_and_the_table_adds_up():
    result = plan(micro_config(mesh=dict(fsdp=8)), sharding=True)
    n = result["n_params"]
    state = result["state_bytes_per_device"]
    assert state["params"] == pytest.approx(4 * n / 8, rel=0.01)
    assert state["optimizer"] == pytest.approx(8 * n / 8, rel=0.01)  # Adam: two fp32 moments
    assert sum(r["bytes_per_device"] for r in result["sharding"]) == state["params"]
    gathered = result["collectives"]["measured"]["all-gather"]["sent"]
    # Forward and backward each gather the 7/8 of the weights a device lacks.
    assert gathered == pytest.approx(result["collectives"]["textbook"]["all-gather"], rel=0.25)


def test_tensor_parallel_activation_all_reduces_match_megatron():
    cfg = micro_config(mesh=dict(fsdp=1, tensor=8), model=dict(n_heads=8, n_kv_heads=8))
    result = plan(cfg, devices=jax.devices()[:8], sharding=True)
    row = {r["name"]: r for r in result["sharding"]}["layers.mlp.w_up"]
    assert row["spec"] == "(None, None, 'tensor')" and row["bytes_per_device"] == 2 * 64 * 128 * 4 // 8
    measured = result["collectives"]["measured"]["all-reduce"]
    # Two activation all-reduces per layer forward and two backward, plus a few for the
    # vocabulary-parallel logits and the loss statistics (measured: 13 for 2 layers, 1.9x the bytes).
    assert measured["count"] >= 4 * cfg.model.n_layers
    textbook = result["collectives"]["textbook"]["all-reduce"]
    assert textbook <= measured["sent"] <= 2.5 * textbook
