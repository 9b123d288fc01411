"""The model against its definition: causality, document isolation, RoPE, and a NumPy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parallelism.rules import DEFAULT_RULES
from trainer.model.decoder import NO_SHARDING, Decoder, ModelDef
from trainer.model.primitives import apply_rope, rope_tables
from trainer.model.spec import Architecture, Execution, ModelSpec, RopeScaling

ARCH = Architecture(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96)
SPEC = ModelSpec(ARCH)


def running(**execution) -> ModelSpec:
    return ModelSpec(ARCH, Execution(**execution))


def make(spec=SPEC, seed=0):
    return Decoder(spec, rngs=nnx.Rngs(seed))


def tokens(b=2, t=24, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 3, ARCH.vocab_size)


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_changing_a_token_changes_no_earlier_logit(attention):
    model = make(running(attention=attention))
    x = tokens()
    base = model(x)
    t = 11
    changed = model(x.at[:, t].set((x[:, t] + 7) % ARCH.vocab_size))
    np.testing.assert_array_equal(np.asarray(base[:, :t]), np.asarray(changed[:, :t]))
    assert not np.allclose(np.asarray(base[:, t:]), np.asarray(changed[:, t:]))


@pytest.mark.parametrize("attention", ["xla", "dot_product"])
def test_packed_documents_do_not_see_each_other(attention):
    """Each document in a packed row gives the logits it gives alone, positions restarting at 0."""
    model = make(running(attention=attention))
    lengths = (9, 15)
    x = tokens(b=1, t=sum(lengths))
    segments = jnp.concatenate([jnp.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    positions = jnp.concatenate([jnp.arange(n) for n in lengths])[None]
    packed = model(x, positions, segments)
    start = 0
    for n in lengths:
        alone = model(x[:, start : start + n])
        np.testing.assert_allclose(np.asarray(packed[:, start : start + n]), np.asarray(alone), atol=2e-5)
        start += n


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(m, n):
        qm = apply_rope(q, rope_tables(jnp.array([[m]]), 16, 10_000.0, RopeScaling()))
        kn = apply_rope(k, rope_tables(jnp.array([[n]]), 16, 10_000.0, RopeScaling()))
        return float(jnp.sum(qm * kn))

    for shift in (1, 17, 300):
        assert score(5, 2) == pytest.approx(score(5 + shift, 2 + shift), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_attention_implementations_agree_on_packed_gqa():
    x = tokens(b=2, t=20)
    segments = jnp.array([[1] * 7 + [2] * 13, [1] * 20])
    positions = jnp.array([list(range(7)) + list(range(13)), list(range(20))])
    ref = make(running(attention="xla"))(x, positions, segments)
    fast = make(running(attention="dot_product"))(x, positions, segments)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(fast), atol=2e-5)


@pytest.mark.parametrize("remat", ["none", "full", "save_dots", "save_dots_no_batch"])
@pytest.mark.parametrize("scan", [True, False])
def test_remat_and_scan_change_nothing_numerically(remat, scan):
    params = nnx.to_pure_dict(nnx.state(make()))
    x = tokens()
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)

    def loss_and_grads(spec):
        model = ModelDef.create(spec, NO_SHARDING)

        def loss(p):
            s, n, _, _, _ = model.apply(p, x, positions, None, method="loss_sums")
            return s / n

        return jax.jit(jax.value_and_grad(loss))(params)

    ref_loss, ref_grads = loss_and_grads(SPEC)  # no remat, scanned
    value, grads = loss_and_grads(running(remat=remat, scan_layers=scan))
    assert float(value) == pytest.approx(float(ref_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-7)


def test_every_parameter_carries_known_logical_axes():
    model = ModelDef.create(SPEC, NO_SHARDING)
    leaves = jax.tree_util.tree_leaves_with_path(model.abstract_params)
    names = dict(jax.tree_util.tree_leaves_with_path(model.logical_names, is_leaf=lambda x: isinstance(x, tuple)))
    assert len(names) == len(leaves) > 0
    for path, array in leaves:
        axes = names[path]
        assert len(axes) == array.ndim, path
        assert set(axes) <= set(DEFAULT_RULES), axes
    stacked = model.abstract_params["layers"]["mlp"]["w_up"]
    assert stacked.shape == (ARCH.n_layers, ARCH.d_model, ARCH.d_ff)


# ---- an independent NumPy implementation of the same model, float64 ----


def _np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_rope(x, positions, theta):
    h = x.shape[-1]
    inv = theta ** (-np.arange(0, h, 2) / h)
    ang = positions[..., None] * inv  # b t h/2
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def numpy_loss(p, spec, tok, segments, positions):
    """(mean next-token loss, sum of log(Z)^2 over the targets, largest |logit|), in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    b, t = tok.shape
    x = p["embed"][tok]
    groups = spec.n_heads // spec.n_kv_heads
    causal = np.tril(np.ones((t, t), bool))
    mask = causal[None] & (segments[:, :, None] == segments[:, None, :])  # b t s
    for i in range(spec.n_layers):
        lp = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        h = _np_rms(x, lp["attn_norm"]["scale"], spec.norm_eps)
        q = _np_rope(np.einsum("btd,dnh->btnh", h, lp["attn"]["wq"]), positions, spec.rope_theta)
        k = _np_rope(np.einsum("btd,dkh->btkh", h, lp["attn"]["wk"]), positions, spec.rope_theta)
        v = np.einsum("btd,dkh->btkh", h, lp["attn"]["wv"])
        k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)  # kv head j serves queries j*g..j*g+g-1
        scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(spec.head_dim)
        scores = np.where(mask[:, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("bnts,bsnh,nhd->btd", probs, v, lp["attn"]["wo"])
        h = _np_rms(x, lp["mlp_norm"]["scale"], spec.norm_eps)
        gate = h @ lp["mlp"]["w_gate"]
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ lp["mlp"]["w_up"])) @ lp["mlp"]["w_down"]
    x = _np_rms(x, p["final_norm"]["scale"], spec.norm_eps)
    logits = x @ (p["embed"].T if spec.tie_embeddings else p["lm_head"])
    log_probs = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    log_z = logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    losses, z_sq = [], 0.0
    for bi in range(b):
        for ti in range(t - 1):
            if segments[bi, ti + 1] == segments[bi, ti] and segments[bi, ti] > 0:
                losses.append(-log_probs[bi, ti, tok[bi, ti + 1]])
                z_sq += log_z[bi, ti] ** 2
    return float(np.mean(losses)), z_sq, float(np.abs(logits).max())


@pytest.mark.parametrize("tie,chunk", [(False, 0), (True, 0), (False, 4)])
def test_the_training_loss_matches_a_numpy_reference(tie, chunk):
    """Through `loss_sums`, the path the train and eval steps take, whole and chunked."""
    spec = ModelSpec(dataclasses.replace(ARCH, tie_embeddings=tie), Execution(loss_chunk=chunk))
    model = ModelDef.create(spec, NO_SHARDING)
    params = nnx.to_pure_dict(nnx.state(make(spec, seed=3)))
    assert ("lm_head" in params) is not tie
    tok = np.asarray(tokens(b=2, t=16, seed=4))
    segments = np.array([[1] * 6 + [2] * 8 + [0] * 2, [1] * 16])  # packing and padding
    positions = np.array([list(range(6)) + list(range(8)) + [0, 0], list(range(16))])
    s, n, log_z_sq, largest, _ = model.apply(params, tok, positions, segments, method="loss_sums")
    loss, z_sq, biggest = numpy_loss(params, spec.arch, tok, segments, positions)
    assert float(n) == 5 + 7 + 15
    assert float(s / n) == pytest.approx(loss, rel=1e-5)
    assert float(log_z_sq) == pytest.approx(z_sq, rel=1e-5)
    assert float(largest) == pytest.approx(biggest, rel=1e-5)
