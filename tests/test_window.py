"""Sliding-window attention (model.sliding_window, Gemma 3's local layers): every kernel against a numpy
reference, the context axis and a mesh against one device, and the splash kernel's cost counting only the
blocks its local mask runs. Decoding with a local layer's ring cache is checked against transformers' Gemma
3 in tests/test_huggingface.py."""

import jax
import numpy as np
import pytest
from test_attention import packed_gqa, value_and_grads
from test_context import loss_grads_logits, packed_batch

from trainer.model.attention import _jax_nn_attention, xla_attention
from trainer.model.splash import call_cost, splash_attention

WINDOW = 100  # crosses the 128-token blocks


def numpy_attention(q, k, v, segments, window):
    """Softmax attention written out position by position: query i sees key j <= i of its own document
    with i - j < window."""
    q, k, v, segments = (np.asarray(x, np.float64) for x in (q, k, v, segments))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for row in range(b):
        for i in range(t):
            seen = [j for j in range(max(0, i - window + 1), i + 1) if segments[row, j] == segments[row, i]]
            for head in range(n):
                scores = np.array([q[row, i, head] @ k[row, j, head // group] for j in seen]) / np.sqrt(h)
                p = np.exp(scores - scores.max())
                out[row, i, head] = (p / p.sum()) @ v[row, seen, head // group]
    return out


def test_every_kernel_masks_the_window_as_the_numpy_reference():
    """xla (the reference kernel), jax.nn.dot_product_attention's local_window_size, and splash's LocalMask
    (Pallas interpret mode, 128-token blocks): the same outputs as the numpy reference, and splash's
    gradients those of xla."""
    q, k, v, segments = packed_gqa(t=256)
    expected = numpy_attention(q, k, v, segments, WINDOW)
    kernels = {"xla": lambda q, k, v, s: xla_attention(q, k, v, s, WINDOW),
               "dot_product": lambda q, k, v, s: _jax_nn_attention(q, k, v, s, None, WINDOW),
               "splash": lambda q, k, v, s: splash_attention(q, k, v, s, block=128, window=WINDOW)}  # fmt: skip
    for name, kernel in kernels.items():
        np.testing.assert_allclose(kernel(q, k, v, segments), expected, atol=2e-5, err_msg=name)
    (ref, ref_grads), (got, grads) = (value_and_grads(kernels[n], q, k, v, segments) for n in ("xla", "splash"))
    assert float(got) == pytest.approx(float(ref), abs=1e-3)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"d{name}")


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
