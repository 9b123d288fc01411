"""Multi-token prediction (model.mtp.*, DeepSeek-V3's form): each module's targets, masks and loss against a
reference written position by position, the step's objective and gradients, and the run's metrics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config
from flax import nnx
from test_context import packed_batch

from trainer.training.setup import build
from trainer.training.step import _sums

DEPTH, WEIGHT = 2, 0.3


def reference_mtp(model, params, batch):
    """Each module's (cross-entropy sum, target count): module k at position i reads token i + k and predicts
    token i + k + 1, when that token is in position i's document (not padding); written out per position."""
    tokens, ids = np.asarray(batch["tokens"]), np.asarray(batch["segment_ids"])
    rows, seq = tokens.shape
    decoder = nnx.merge(model.graphdef, params)
    _, _, hidden = decoder._through_layers(batch["tokens"], batch["positions"], batch["segment_ids"])
    tables = decoder._tables(batch["positions"])
    graphdef, stacked = nnx.split(decoder.mtp)
    out = []
    for k in range(1, DEPTH + 1):
        module = nnx.merge(graphdef, jax.tree.map(lambda p, i=k - 1: p[i], stacked))
        ahead = np.zeros_like(tokens)
        for b in range(rows):
            for i in range(seq - k):
                ahead[b, i] = tokens[b, i + k]
        hidden = module(hidden, decoder._embed(jnp.asarray(ahead)), tables, batch["segment_ids"])
        logprobs = jax.nn.log_softmax(decoder.logits(module.out_norm(hidden)), axis=-1)
        target, valid = np.zeros_like(tokens), np.zeros(tokens.shape, np.float32)
        for b in range(rows):
            for i in range(seq - k - 1):
                if ids[b, i] > 0 and ids[b, i + k + 1] == ids[b, i]:
                    target[b, i], valid[b, i] = tokens[b, i + k + 1], 1.0
        picked = jnp.take_along_axis(logprobs, jnp.asarray(target)[..., None], axis=-1)[..., 0]
        out.append((-jnp.sum(picked * valid), int(valid.sum())))
    return out


def test_each_module_predicts_its_token_within_the_document_and_enters_the_loss_weighted():
    """Packed documents with padding: each module's cross-entropy sum and count equal the reference's;
    the step's objective is the main cross-entropy plus weight / depth x the modules' sums, and its
    gradients (the modules', the shared embedding and head's, the decoder's) those of that sum."""
    cfg = micro_config(model=dict(mtp=dict(depth=DEPTH, weight=WEIGHT)))
    setup = build(cfg)
    params = jax.device_get(setup.new_state().params)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(rows=8, seq=32).items()}
    model = setup.model
    stats = jax.jit(lambda p: model.apply(p, *(batch[k] for k in ("tokens", "positions", "segment_ids")),
                                          method="loss_sums")[4])(params)  # fmt: skip
    expected = jax.jit(lambda p: reference_mtp(model, p, batch))(params)
    np.testing.assert_allclose(stats["mtp"]["ce"], [ce for ce, _ in expected], rtol=1e-5)
    np.testing.assert_array_equal(stats["mtp"]["count"], [n for _, n in expected])
    assert 0 < expected[1][1] < expected[0][1]  # the second module has fewer targets

    def reference(p):
        main = model.apply(p, batch["tokens"], batch["positions"], batch["segment_ids"], method="loss_sums")[0]
        return main + WEIGHT / DEPTH * sum(ce for ce, _ in reference_mtp(model, p, batch))

    objective, grads = jax.jit(jax.value_and_grad(lambda p: _sums(model, p, batch, 0.0, None, WEIGHT)[0]))(params)
    ref_objective, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert float(objective) == pytest.approx(float(ref_objective), rel=1e-6)
    assert np.abs(np.asarray(grads["mtp"]["proj"])).max() > 0
    for path, a in jax.tree_util.tree_leaves_with_path(grads):
        b = ref_grads
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))
