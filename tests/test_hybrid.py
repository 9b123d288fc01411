"""Hybrid linear attention (Qwen3.5's Gated DeltaNet, trainer/model/delta.py): the rule in chunks and token by
token against transformers' torch forms, and packed documents as each alone. Qwen3.5's import, decoding and
export against transformers are in test_huggingface.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config

from trainer.config.errors import ConfigError
from trainer.model import delta
from trainer.model.decoder import NO_SHARDING, ModelDef, init_params
from trainer.model.spec import ModelSpec
from trainer.training.validation import validate

HYBRID = dict(n_layers=4, head_dim=16, qk_norm=True, attention_gate=True, centred_norms=True, rope_fraction=0.25,
              layer_types=("linear_attention",) * 3 + ("full_attention",),
              linear=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4))  # fmt: skip


def rule_inputs(seed: int, b: int = 2, t: int = 100, kh: int = 2, vh: int = 4, dk: int = 8, dv: int = 6):
    """q, k (b, t, kh, dk) as the layer gives them (before their L2 norm), v (b, t, vh, dv), a decay g < 0 and
    a write strength beta in (0, 1) (b, t, vh), and a state to start from (b, vh, dk, dv)."""
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=(b, t, kh, dk)), rng.normal(size=(b, t, kh, dk))
    v = rng.normal(size=(b, t, vh, dv))
    g = -np.exp(rng.normal(size=(b, t, vh))) * np.log1p(np.exp(rng.normal(size=(b, t, vh))))
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, vh))))
    state = 0.5 * rng.normal(size=(b, vh, dk, dv))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, state))


def test_the_gated_delta_rule_in_chunks_and_token_by_token_equals_transformers():
    """100 tokens (a chunk of 64 and a part of one), two key heads each serving two value heads, from a given
    state: our chunked form and our recurrent one give transformers' torch_chunk_gated_delta_rule's outputs and
    final state (which its token-by-token form also gives) to 1e-5, and the same gradients (the chunked
    form's triangular inverse has its own backward pass). With two documents packed in the row (the boundary
    inside the first chunk), the two forms still agree: each restarts the state there."""
    torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
    pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta, state = rule_inputs(0)
    given = [torch.tensor(x) for x in (q, k, v)]
    theirs = [hf.torch_chunk_gated_delta_rule(*given, g=torch.tensor(g), beta=torch.tensor(beta), chunk_size=64,
                                              initial_state=torch.tensor(state), output_final_state=True,
                                              use_qk_l2norm_in_kernel=True),
              hf.torch_recurrent_gated_delta_rule(*given, g=torch.tensor(g), beta=torch.tensor(beta),
                                                  initial_state=torch.tensor(state), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)]  # fmt: skip
    out, last = (x.numpy() for x in theirs[0])
    np.testing.assert_allclose(theirs[1][0].numpy(), out, rtol=1e-5, atol=1e-5)
    q, k = (jnp.repeat(delta.l2_normalised(jnp.asarray(x)), 2, axis=2) for x in (q, k))
    for form in (delta.chunked, delta.recurrent):
        ours, ours_last = jax.jit(form)(q, k, v, g, beta, state)
        np.testing.assert_allclose(ours, out, rtol=1e-5, atol=1e-5, err_msg=form.__name__)
        np.testing.assert_allclose(ours_last, last, rtol=1e-5, atol=1e-5, err_msg=form.__name__)
    weights = np.random.default_rng(1).normal(size=out.shape).astype(np.float32)
    grads = [jax.jit(jax.grad(lambda *a, form=form: jnp.sum(form(*a, state)[0] * weights), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, g, beta) for form in (delta.chunked, delta.recurrent)]  # fmt: skip
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    ids = np.stack([np.r_[np.ones(37), np.full(63, 2)], np.r_[np.ones(90), np.zeros(10)]]).astype(np.int32)
    chunked = jax.jit(delta.chunked)(q, k, v, g, beta, None, ids)
    recurrent = jax.jit(delta.recurrent)(q, k, v, g, beta, None, ids)
    for a, b in zip(chunked, recurrent, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    alone = jax.jit(delta.recurrent)(q[:1, 37:], k[:1, 37:], v[:1, 37:], g[:1, 37:], beta[:1, 37:])[0]
    np.testing.assert_allclose(chunked[0][:1, 37:], alone, rtol=1e-5, atol=1e-5)


def test_a_packed_row_through_a_hybrid_equals_each_document_alone():
    """A hybrid (three Gated DeltaNet layers, then gated full attention with partial RoPE) given two documents
    packed in one row (70 and 50 tokens: the boundary inside the second chunk of 64) and padding: each
    document's logits are those of the document run alone, as attention's segment mask gives them, because
    the recurrent state and the convolution's window start afresh at the boundary."""
    cfg = micro_config(model=dict(**HYBRID, max_seq_len=128), data=dict(seq_len=128))
    validate(cfg)
    spec = ModelSpec.from_config(cfg)
    model, params = ModelDef.create(spec, NO_SHARDING), init_params(spec, NO_SHARDING, 0)
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 384, 70), rng.integers(3, 384, 50)]
    tokens = np.concatenate([*docs, np.zeros(8, np.int64)])[None]
    positions = np.concatenate([np.arange(70), np.arange(50), np.zeros(8, np.int64)])[None]
    ids = np.repeat([1, 2, 0], [70, 50, 8])[None]
    apply = jax.jit(model.apply)
    packed = np.asarray(apply(params, tokens, positions, ids))
    for doc, start in zip(docs, (0, 70), strict=True):
        alone = np.asarray(apply(params, doc[None], np.arange(len(doc))[None], np.ones((1, len(doc)), np.int32)))
        np.testing.assert_allclose(packed[0, start : start + len(doc)], alone[0], rtol=1e-5, atol=1e-5)
    # The convolution mixes neighbours: without the boundary the second document would read the first's end.
    joined = np.asarray(apply(params, tokens, positions, np.ones_like(ids)))
    assert np.abs(joined[0, 70:72] - packed[0, 70:72]).max() > 1e-3


@pytest.mark.parametrize(
    "changes, says",
    [
        (dict(layer_types=("linear_attention",) * 3), "has 3 entries for model.n_layers=4"),
        (dict(layer_types=("linear_attention", "full_attention", "local", "full_attention")),
         "model.layer_types' entry='local' is not one of linear_attention, full_attention"),
        (dict(linear=dict(key_heads=3, value_heads=4)), "value_heads=4 is not a multiple of model.linear.key_heads=3"),
        (dict(sliding_window=16), "and model.sliding_window=16 is not supported"),
        (dict(mesh=dict(stage=2)), "and mesh.stage=2 (pipeline stages) is not supported here"),
        (dict(moe=dict(num_experts=4, shared_experts=1, dense_layers=1)),
         "and dense layers among its experts (model.moe.dense_layers=1, every=1: experts go in every layer) is not"),
        (dict(moe=dict(num_experts=4, router="sigmoid")),
         "and a router other than softmax without bias (model.moe.router=sigmoid, router_bias=0.0) is not"),
        (dict(moe=dict(num_experts=4, shared_gate=True)),
         "model.moe.shared_gate=true gates the shared experts' output, and model.moe.shared_experts is 0"),
        (dict(mesh=dict(context=2)), "and mesh.context=2 is not supported here: the recurrent state runs through"),
        (dict(mesh=dict(tensor=4), n_heads=4, n_kv_heads=4),
         "model.linear.key_heads=2 does not divide over mesh.tensor=4"),
    ],
)  # fmt: skip
def test_a_hybrid_that_cannot_work_is_one_sentence(changes, says):
    """Settings a hybrid cannot run with, each refused in one sentence before anything compiles: by the
    config's checks, or (the mesh's) when the mesh is laid out."""
    from trainer.training.setup import build

    changes = dict(changes)
    mesh = changes.pop("mesh", {})
    model = {**HYBRID, **changes, "linear": {**HYBRID["linear"], **changes.get("linear", {})}}
    cfg = micro_config(model=model, mesh={"fsdp": 1, "data": -1, **mesh})
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")) as info:
        build(cfg) if mesh else validate(cfg)  # the mesh's checks need its devices; the rest are the config's
    assert "\n" not in str(info.value)


def test_the_planner_counts_a_hybrids_rollout_cache_as_the_sampler_holds_it():
    """GRPO's planned cache (trainer/planning/memory.py rollout_bytes: each linear layer's state and convolution
    inputs, each attention layer's keys and values, held twice) against the bytes a device holds of the cache
    the sampler makes (trainer/model/sampling.py empty_cache), on data 2 x fsdp 2 x tensor 2."""
    from parallelism.rules import LogicalSharding
    from trainer.model.sampling import empty_cache
    from trainer.planning.memory import rollout_bytes
    from trainer.training.setup import build

    cfg = micro_config(model=HYBRID, mesh=dict(data=2, fsdp=2, tensor=2))
    setup = build(cfg)
    rules = {**dict(setup.shard.rules), "seq": (), "residual_seq": ()}  # the sampler's, rows split (split_batch)
    shard = LogicalSharding.create(setup.mesh, rules)
    cache = jax.jit(lambda: empty_cache(setup.spec, cfg.train.global_batch_size, cfg.data.seq_len, shard))()
    held = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(cache))
    assert rollout_bytes(cfg, setup)["kv_cache"] == 2 * held
