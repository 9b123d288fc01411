"""The splash-attention kernel (Pallas, interpret mode on a CPU) against the einsum reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding
from trainer.model.attention import resolve, splash_attention, splash_block, xla_attention


def packed_gqa(b=2, t=256, n=4, kv=2, h=64):
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, heads, h)) for i, heads in enumerate((n, kv, kv)))
    # Three documents in the first row of each pair (for t = 256: 100, 37 and 119 tokens, boundaries
    # inside blocks), one in the second.
    a, c = 100 * t // 256, 137 * t // 256
    segments = jnp.array([[1] * a + [2] * (c - a) + [3] * (t - c), [1] * t] * (b // 2))
    return q, k, v, segments


def value_and_grads(attention, q, k, v, segments):
    weights = jax.random.normal(jax.random.key(9), q.shape)  # a loss that weighs every output differently
    return jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v, segments) * weights), (0, 1, 2))(q, k, v)


def test_splash_matches_the_reference_forward_and_backward_on_packed_gqa():
    q, k, v, segments = packed_gqa()
    out = splash_attention(q, k, v, segments, block=128)  # 2 x 2 blocks: the masks cross block edges
    np.testing.assert_allclose(out, xla_attention(q, k, v, segments), atol=2e-5)
    (ref, ref_grads), (got, grads) = (value_and_grads(f, q, k, v, segments) for f in (
        xla_attention, lambda q, k, v, s: splash_attention(q, k, v, s, block=128)))  # fmt: skip
    assert float(got) == pytest.approx(float(ref), abs=1e-3)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")


def test_splash_under_a_mesh_runs_per_shard_and_matches():
    """Batch over data x fsdp and heads over tensor through shard_map: the same numbers."""
    cfg = micro_config(mesh=dict(data=2, fsdp=2, tensor=2))
    mesh = make_mesh(cfg.mesh)
    shard = LogicalSharding.create(mesh)
    q, k, v, segments = packed_gqa(b=4, t=128)
    out = jax.jit(lambda q, k, v, s: splash_attention(q, k, v, s, shard))(q, k, v, segments)
    np.testing.assert_allclose(out, xla_attention(q, k, v, segments), atol=2e-5)


def test_auto_and_block_sizes():
    assert (resolve("auto", "tpu"), resolve("auto", "gpu"), resolve("auto", "cpu")) == ("splash", "cudnn", "xla")
    assert resolve("dot_product", "tpu") == "dot_product"
    assert (splash_block(2048), splash_block(8192), splash_block(384), splash_block(128), splash_block(48)) == (
        512, 512, 128, 128, 48)  # fmt: skip
