"""Sliding-window attention (model.sliding_window, Gemma 3's local layers): every kernel against a numpy
reference, the context axis and a mesh against one device, and the splash kernel's cost counting only the
blocks its local mask runs. Decoding with a local layer's ring cache is checked against transformers' Gemma
3 in tests/test_huggingface.py."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, micro_config
from test_attention import packed_gqa, value_and_grads
from test_context import loss_grads_logits, packed_batch

from parallelism.mesh import make_mesh
from parallelism.rules import LogicalSharding
from trainer.config.errors import ConfigError
from trainer.config.forms import from_file
from trainer.interop.families import hf_config
from trainer.model.attention import _jax_nn_attention, xla_attention
from trainer.model.decoder import layer_plan
from trainer.model.flops import attention_forward_flops
from trainer.model.spec import Architecture, Experts
from trainer.model.splash import call_cost, splash_attention

WINDOW = 100  # crosses the 128-token blocks
BASE = dict(vocab_size=384, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128)


def numpy_attention(q, k, v, segments, window, sinks=None):
    """Softmax attention in float64 numpy, with the visibility written out: query i sees key j when
    i - window < j <= i and both are in one document; `sinks` (heads,) add exp(sink) to each denominator."""
    q, k, v, segments = (np.asarray(x, np.float64) for x in (q, k, v, segments))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    seen = (j <= i) & (i - j < window) & (segments[:, :, None] == segments[:, None, :])  # (b, t, t)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # each query head's key/value head
    scores = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(h)
    weights = np.where(seen[:, None], np.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - scores.max(-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", weights / total, v)


def test_every_kernel_masks_the_window_as_the_numpy_reference():
    """xla (the reference kernel: masked, or in chunks of a window that divides the sequence),
    jax.nn.dot_product_attention's local_window_size, and splash's LocalMask (Pallas interpret mode,
    128-token blocks): the same outputs as the numpy reference, and splash's gradients those of xla."""
    q, k, v, segments = packed_gqa(t=256)
    expected = numpy_attention(q, k, v, segments, WINDOW)
    kernels = {"xla": lambda q, k, v, s: xla_attention(q, k, v, s, WINDOW),
               "dot_product": lambda q, k, v, s: _jax_nn_attention(q, k, v, s, None, WINDOW),
               "splash": lambda q, k, v, s: splash_attention(q, k, v, s, block=128, window=WINDOW)}  # fmt: skip
    for name, kernel in kernels.items():
        np.testing.assert_allclose(kernel(q, k, v, segments), expected, atol=2e-5, err_msg=name)
    # A window that divides the sequence: xla in chunks of the window (64 here), each over its pair of chunks
    chunked = numpy_attention(q, k, v, segments, 64)
    np.testing.assert_allclose(xla_attention(q, k, v, segments, 64), chunked, atol=2e-5, err_msg="chunked")
    np.testing.assert_allclose(xla_attention(q, k, v, None, 64), numpy_attention(q, k, v, 0 * segments, 64),
                               atol=2e-5, err_msg="chunked, no segments")  # fmt: skip
    (ref, ref_grads), (got, grads) = (value_and_grads(kernels[n], q, k, v, segments) for n in ("xla", "splash"))
    assert float(got) == pytest.approx(float(ref), abs=1e-3)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")


@pytest.mark.slow
def test_the_context_axis_trains_local_and_global_layers_as_one_device():
    """Gemma 3's pattern at micro size (every second layer global, local RoPE base apart), packed documents,
    a window of 5 over 32 tokens: the ring over context 2 x fsdp 2 x tensor 2 (its half blocks masked by the
    window too) gives one device's loss, gradients and logits."""
    model = dict(sliding_window=5, global_every=2, local_rope_theta=500.0)
    batch = packed_batch()
    loss, grads, logits, _, params = loss_grads_logits("ring", {}, batch, model=model)
    whole = loss_grads_logits("ring", {}, batch, params, model={**model, "sliding_window": 32})[0]
    assert abs(whole - loss) > 1e-4  # the window changes the model (a window of 32 sees every earlier token)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    other, other_grads, other_logits, _, _ = loss_grads_logits("ring", dict(context=2, fsdp=2, tensor=2), batch,
                                                               params, model=model)  # fmt: skip
    assert other == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(other_logits, logits, atol=1e-5)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)


@pytest.mark.parametrize("t, block, window", [(4096, 512, 1024), (8192, 1024, 512)])
def test_splash_cost_counts_only_the_blocks_inside_the_window(t, block, window):
    """The kernel runs a (query block, key block) step only where the band i - window < j <= i meets the
    block: counted here by brute force over the blocks. A local layer's FLOPs are a causal layer's in the
    ratio of the two counts."""
    blocks = t // block
    first, last = np.arange(blocks) * block, np.arange(blocks) * block + block - 1
    # block pair (i, j) holds some visible (query, key): its last query is at or after its first key, and its
    # first query within the window of its last key
    runs = int(np.sum((last[:, None] >= first[None, :]) & (first[:, None] - last[None, :] < window)))
    causal = blocks * (blocks + 1) // 2
    local_flops = call_cost("fwd", 4, 1, t, 128, 1, 2, block, block, segmented=True, window=window)[0]
    causal_flops = call_cost("fwd", 4, 1, t, 128, 1, 2, block, block, segmented=True)[0]
    assert local_flops == 4 * runs * 2 * (2 * block * block * 128)
    assert local_flops / causal_flops == pytest.approx(runs / causal) and runs < causal


def test_a_window_with_no_hugging_face_counterpart_is_refused_in_one_sentence():
    """Local and global layers without Gemma's details (Llama has no window; Mistral's is on every layer), and a
    window with query/key norms (Qwen3's form has none here): the export's config refuses them, before any
    file is written (hf_config runs first, tests/test_huggingface.py)."""
    base = BASE
    for model, said in [(dict(sliding_window=8, global_every=2), "model.global_every=2"),
                        (dict(sliding_window=8, qk_norm=True), "model.sliding_window=8"),
                        (dict(post_norms=True), "lacks embed_scale, mlp_activation, qk_norm")]:  # fmt: skip
        with pytest.raises(ConfigError, match=said) as info:
            hf_config(Architecture(**base, **model), 64)
        assert "\n" not in str(info.value) and "no Hugging Face form" in str(info.value)
    assert hf_config(Architecture(**base, sliding_window=8), 64)["architectures"] == ["MistralForCausalLM"]


def test_gemma3s_layers_run_as_four_units_and_a_tail_and_count_their_windows_flops():
    """Gemma 3 1B's 26 layers (configs/gemma3_1b.py): 4 units of five local layers and a global one, then two
    local, three scan bodies in all; its attention FLOPs at 8192 tokens count 512 keys for each of the 22
    local layers and 8192 for each of the 4 global ones."""
    cfg = from_file(os.path.join(REPO, "configs", "gemma3_1b.py"))
    arch = Architecture.from_config(cfg)
    assert layer_plan(tuple(s for s, _ in arch.stacks())) == [(4, [("local_layers", 5), ("layers", 1)]),
                                                               (1, [("local_layers", 2)])]  # fmt: skip
    assert attention_forward_flops(arch, 8192) == 4 * 4 * 256 * (22 * 512 + 4 * 8192)
    # A mixture's dense head and its units of (dense, MoE) run as before the windows came
    moe = Architecture(**{**BASE, "n_layers": 5}, moe=Experts(num_experts=4, dense_layers=1, every=2))
    assert layer_plan(tuple(s for s, _ in moe.stacks())) == [(1, [("dense_layers", 1)]),
                                                             (2, [("dense_between", 1), ("layers", 1)])]  # fmt: skip


def test_attention_sinks_take_their_share_of_every_softmax_in_xla_and_splash():
    """gpt-oss's sinks: each head's learned logit of a key with no value. xla (masked and in chunks of the
    window) and splash (interpret mode, on data 2 x fsdp 2 x tensor 2 too: each device's rows and heads) give
    the numpy reference's outputs, splash the gradients of xla's, the sinks' included."""
    q, k, v, segments = packed_gqa(b=4, t=256)
    sinks = jax.random.normal(jax.random.key(7), (4,)) * 2

    for window in (64, 100):
        expected = numpy_attention(q, k, v, segments, window, sinks)
        got = {"xla": xla_attention(q, k, v, segments, window, sinks),
               "splash": splash_attention(q, k, v, segments, block=128, window=window, sinks=sinks)}  # fmt: skip
        for name, out in got.items():
            np.testing.assert_allclose(out, expected, atol=2e-5, err_msg=f"{name} window {window}")
    mesh = make_mesh(micro_config(mesh=dict(data=2, fsdp=2, tensor=2)).mesh)
    shard = LogicalSharding.create(mesh)
    weights = jax.random.normal(jax.random.key(9), q.shape)

    def loss(attention):
        return lambda q, k, v, s: jnp.sum(attention(q, k, v, s) * weights)

    kernels = {"xla": lambda q, k, v, s: xla_attention(q, k, v, segments, WINDOW, s),
               "splash": lambda q, k, v, s: splash_attention(q, k, v, segments, shard, block=128, window=WINDOW,
                                                             sinks=s)}  # fmt: skip
    ref, got = (jax.jit(jax.grad(loss(kernels[n]), (0, 1, 2, 3)))(q, k, v, sinks) for n in ("xla", "splash"))
    assert np.abs(np.asarray(ref[3])).max() > 1e-3  # the sinks' own gradient is not nothing
    for name, a, b in zip(("q", "k", "v", "sinks"), got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")
