"""The splash-attention kernel (Pallas, interpret mode on a CPU) against the einsum reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from parallelism import hlo
from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding
from trainer.model.attention import resolve, xla_attention
from trainer.model.context import zigzag
from trainer.model.splash import block_size, call_cost, hlo_call_cost, splash_attention
from trainer.planning.plan import kernel_cost


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
    # A chip with no known peak: 512 or the largest below it that divides; none divides: one block.
    assert [block_size(t, 64, 4, "cpu") for t in (2048, 8192, 384, 128, 48)] == [512, 512, 128, 128, 48]
    # Per chip, from the kernel's cost: a v6e's 560 FLOPs a byte take the largest blocks; a v5e's 240 fewer.
    assert block_size(8192, 64, 4, "TPU v6 lite") == 1024 and block_size(2048, 64, 4, "TPU v5 lite") == 512


@pytest.mark.parametrize("t, block, group", [(2048, 512, 2), (1024, 256, 4), (4096, 1024, 1)])
def test_splash_cost_counts_the_causal_blocks_it_runs_and_the_copies_its_pipeline_makes(t, block, group):
    """The kernel's cost from its own block map and index maps, against the closed form of a causal
    call with n = t / block blocks a side (bf16, segment ids, head_dim 64, 3 instances), and its forward
    FLOPs against the reference's HLO, which computes every block."""
    n, d, b, lanes, sub, instances = t // block, 64, 2, 128, 8, 3
    blocks = n * (n + 1) // 2  # on or below the diagonal
    fwd_flops, fwd_bytes = call_cost("fwd", group, 1, t, d, instances, b, block, block, segmented=True)
    dkv_flops, dkv_bytes = call_cost("dkv", group, 1, t, d, instances, b, block, block, segmented=True)
    assert fwd_flops == instances * group * blocks * 2 * (2 * block * block * d)  # QK^T, PV
    assert dkv_flops == instances * group * blocks * 5 * (2 * block * block * d)  # QK^T, dV, dP, dK, dQ

    # Forward, per head: q read and out written once; row i reads key blocks 0..i, except that row 1
    # finds block 0 still there from row 0 (skipped steps point at the next row's first block).
    kv_reads = group * (blocks - 1)
    expected = (2 * group * t * d * b + 2 * kv_reads * block * d * b
                + group * t * lanes * 4  # logsumexp, float32 x 128 lanes
                + 2 * group * t * lanes * 4  # query segment ids and positions, int32 x 128 lanes
                + kv_reads * sub * block * 4  # key segment ids, int32 x 8 sublanes
                + (2 * block * lanes + block * d) * 4)  # fmt: skip  # m, l, o scratch
    assert fwd_bytes == instances * expected
    # Backward, per head: key column j reads query blocks j..n-1, and one more (block 0, for the skipped
    # steps) when j > 0; k, v, dk, dv once; a dq partial written at every step, skipped ones too.
    q_reads = group * (blocks + n - 1)
    expected = (2 * q_reads * block * d * b + 2 * q_reads * sub * block * 4  # q, dO; logsumexp, di
                + 2 * q_reads * sub * block * 4  # query segment ids and positions
                + 4 * t * d * b + t * lanes * 4  # k, v, dk, dv; key segment ids
                + n * group * t * d * b  # dq partials
                + 2 * block * d * 4)  # fmt: skip  # dk, dv scratch
    assert dkv_bytes == instances * expected

    # The split backward (MaxText's): dkv without dQ and without the dq partials; dq on the forward's schedule
    # with QK^T, dP and dQ, reading q and dO and writing dq once per query block.
    split_flops, split_bytes = call_cost("dkv", group, 1, t, d, instances, b, block, block, segmented=True, fused=False)
    assert split_flops == instances * group * blocks * 4 * (2 * block * block * d)
    assert split_bytes == dkv_bytes - instances * n * group * t * d * b
    dq_flops, _ = call_cost("dq", group, 1, t, d, instances, b, block, block, segmented=True)
    assert dq_flops == instances * group * blocks * 3 * (2 * block * block * d)

    # The reference computes all n x n blocks: its HLO's matmul FLOPs x (n + 1) / 2n are the causal ones.
    shapes = [jax.ShapeDtypeStruct((instances, t, heads, d), jnp.bfloat16) for heads in (group, 1, 1)]
    reference = hlo.matmul_flops(hlo.read(jax.jit(xla_attention).lower(*shapes).compile().as_text()))
    assert fwd_flops == pytest.approx(reference * (n + 1) / (2 * n), rel=1e-6)


# One of MaxText's splash calls as its compiled HLO writes it (llm_1b-like on v5e-4, benchmarks/vs_maxtext.py):
# the multi-head form's dq kernel, 4 rows of 32 query heads on 8 key/value heads, the backend config cut out.
MAXTEXT_DQ = (
    "  %splash_mha_dq_segmented_no_residuals.1 = (f32[4,512,64]{2,1,0:T(8,128)}, bf16[4,32,2048,64]{3,2,1,0:T(8,128)"
    '(2,1)}) custom-call(%a, %b, %c, %d, %e), custom_call_target="tpu_custom_call", operand_layout_constraints='
    "{s8[1,4,4]{2,1,0}, s8[1,4,4]{2,1,0}, bf16[4,32,2048,64]{3,2,1,0}, bf16[4,8,2048,64]{3,2,1,0}, "
    "bf16[4,8,2048,64]{3,2,1,0}, s32[4,2048,128]{2,1,0}, s32[4,8,2048]{2,1,0}, f32[4,32,1,2048]{3,2,1,0}, "
    "bf16[4,32,2048,64]{3,2,1,0}, f32[4,32,1,2048]{3,2,1,0}, s32[2048,128]{1,0}}, frontend_attributes="
    '{kernel_metadata={\n"xprof_metadata":"{\\"block_q_dq\\": 512, \\"block_kv_dq\\": 512, '
    '\\"q_layout\\": 1, \\"k_layout\\": 1, \\"v_layout\\": 1}"\n}}'
)


def test_a_splash_call_is_read_from_hlo_in_either_form_and_another_kernel_is_named_not_guessed():
    flops, moved = hlo_call_cost(MAXTEXT_DQ)
    # 2048 tokens in blocks of 512: 10 causal blocks per head, QK^T, dP and dQ on each.
    assert flops == 4 * 32 * 10 * 3 * (2 * 512 * 512 * 64)
    assert moved == call_cost("dq", 32, 8, 2048, 64, 4, 2, 512, 512, segmented=True, residuals=False)[1]
    other = MAXTEXT_DQ.replace("splash_mha_dq_segmented_no_residuals", "megablox_gmm")
    assert hlo_call_cost(other) is None
    text = f"HloModule m\n\nENTRY %main () -> bf16[4,32,2048,64] {{\n{other}\n}}\n"
    kernels = kernel_cost(hlo.read(text))
    # Counted as reading its operands and writing its results once, with no FLOPs, and named.
    operands = 2 * 16 + 2 * (4 * 32 * 2048 * 64) * 2 + 2 * (4 * 8 * 2048 * 64) * 2 + 4 * (4 * 2048 * 128 + 4 * 8 * 2048
               + 2 * 4 * 32 * 2048 + 2048 * 128)  # fmt: skip
    results = 4 * 4 * 512 * 64 + 2 * 4 * 32 * 2048 * 64
    assert kernels == {"calls": 1, "flops": 0.0, "bytes": operands + results, "estimated": [],
                       "uncounted": ["megablox_gmm"]}  # fmt: skip
    # With the estimate its author gave pallas_call (in the call's backend config, as XLA:TPU writes it)
    config = (
        ', backend_config={"custom_call_config":{"body":"TUxJUgA=","cost_estimate":{"flops":"1073741824",'
        '"transcendentals":"0","bytes_accessed":"20709376","remote_bytes_transferred":"0"},"needs_layout":1}}'
    )
    kernels = kernel_cost(hlo.read(text.replace(", frontend_attributes=", config + ", frontend_attributes=")))
    assert kernels == {"calls": 1, "flops": 1073741824.0, "bytes": 20709376.0, "estimated": ["megablox_gmm"],
                       "uncounted": []}  # fmt: skip


def test_a_context_shards_splash_call_counts_the_blocks_its_zigzag_queries_meet():
    """One device's share of a context axis, its queries in the zig-zag layout over all the keys (the split
    backward's dq kernel): the blocks it computes, counted from the queries' original positions (a block
    runs if its latest query is not before the key block's first key), for the busiest of the devices."""
    t, context, block = 8192, 4, 512
    queries = t // context
    positions = zigzag(t, context).reshape(context, queries // block, block)
    runs = max(sum(int(b.max() >= j * block) for b in device for j in range(t // block)) for device in positions)
    shard = MAXTEXT_DQ.replace("2048", str(t)).replace(f"bf16[4,32,{t},64]{{3,2,1,0}}, bf16[4,8,{t}",
                                                       f"bf16[4,32,{queries},64]{{3,2,1,0}}, bf16[4,8,{t}")  # fmt: skip
    flops, moved = hlo_call_cost(shard)
    assert flops == 4 * 32 * runs * 3 * (2 * block * block * 64)
    # Zig-zag spreads the causal work: the busiest device's share is within a block row of a quarter of the
    # square schedule's (n (n + 1) / 2 blocks, n = 16).
    assert abs(runs - 16 * 17 / 2 / context) <= t // block
    assert moved == call_cost("dq", 32, 8, t, 64, 4, 2, block, block, segmented=True, residuals=False, context=4)[1]


def test_the_gathered_keys_through_jax_nn_equal_the_reference_on_cudnn_where_there_is_a_gpu():
    """all_gather's fused form (model.attention=cudnn): each of 2 context shards' queries over the gathered
    keys, the axis emulated by vmap so that one device runs both; forward and gradients against the einsum
    reference. On a GPU the kernel is cuDNN's (bf16, as it requires); elsewhere JAX's XLA path checks the
    ordering and masks."""
    from trainer.model.attention import gathered_attention, gathered_local
    from trainer.model.context import zigzag

    gpu = jax.devices()[0].platform == "gpu"
    dtype, atol = (jnp.bfloat16, 2e-2) if gpu else (jnp.float32, 2e-5)
    q, k, v, segments = packed_gqa(t=256)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    order = zigzag(256, 2)

    def split(x):  # the zig-zag layout, one slice per context shard: (2, batch, 128, ...)
        return jnp.moveaxis(x[:, order].reshape(x.shape[0], 2, 128, *x.shape[2:]), 1, 0)

    def joined(x):  # back to the sequence's order
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], 256, *x.shape[3:])[:, np.argsort(order)]

    def gathered(q, k, v, s):
        local = lambda q, k, v, s: gathered_local(q, k, v, s, 256, 2, "cudnn" if gpu else None)  # noqa: E731
        return joined(jax.vmap(local, axis_name="context")(split(q), split(k), split(v), split(s)))

    out = jax.jit(gathered)(q, k, v, segments)
    reference = xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), segments)
    np.testing.assert_allclose(out.astype(jnp.float32), reference, atol=atol)
    if not gpu:  # and through shard_map on 8 devices, context 2 x fsdp 2 x tensor 2, as the model calls it
        shard = LogicalSharding.create(make_mesh(micro_config(mesh=dict(context=2, fsdp=2, tensor=2)).mesh))
        laid_out = [x[:, order] for x in (q, k, v, segments)]  # the decoder's zig-zag layout
        mapped = jax.jit(lambda *a: gathered_attention(*a, shard, implementation=None))(*laid_out)
        np.testing.assert_allclose(mapped[:, np.argsort(order)], reference, atol=atol)
    _, grads = jax.jit(lambda *a: value_and_grads(gathered, *a))(q, k, v, segments)
    _, ref_grads = value_and_grads(xla_attention, *(x.astype(jnp.float32) for x in (q, k, v)), segments)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=10 * atol, err_msg=f"d{name}")
