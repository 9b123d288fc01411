"""QLoRA (model.lora.base = nf4 or int8): the base quantised as it is read from checkpoint.init_from equals
bitsandbytes' nf4 (blocks of 64 of a torch [out, in] weight) and int8's closed form in numpy; the adapted
model with that base gives the logits of the float model applied to bitsandbytes' dequantised weights with
the adapters folded in; a QLoRA run trains its adapters alone, keeps the base's bits, resumes exactly; and the
planner counts the quantised base at its stored bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HYBRID, micro_config

from trainer.model import adapters, quantised
from trainer.model.decoder import ModelDef, init_params
from trainer.model.spec import ModelSpec
from trainer.planning.memory import state_bytes
from trainer.run.loop import train
from trainer.training.resume import load_init_params, load_params
from trainer.training.setup import build
from trainer.training.state import abstract_params, frozen

torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
bnb = pytest.importorskip("bitsandbytes.functional", reason="the post extra is not installed: pip install -e '.[post]'")

# Two heads of 64 and d_model 128: every quantised axis holds whole blocks of 64, as an 8B model's do.
SHAPE = dict(d_model=128, n_heads=2, n_kv_heads=1, d_ff=256)
# Our weight layout -> torch's [out, in]: (number of input axes, number of output axes) after the layer axis.
LAYOUT = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def qlora(base: str, **sections):
    cfg = micro_config(model=SHAPE, **sections)
    cfg.model.lora.update(rank=4, alpha=8.0, base=base)
    return cfg


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("base") / "run")
    train(micro_config(model=SHAPE, train=dict(steps=3), checkpoint={"every_steps": 3}), path)
    return path


def bnb_nf4(w: np.ndarray, n_in: int) -> np.ndarray:
    """bitsandbytes' nf4 round trip of one layer's weight, taken as torch holds it ([out, in], blocks of 64)."""
    fan_in = int(np.prod(w.shape[:n_in]))
    t = torch.from_numpy(np.ascontiguousarray(w.reshape(fan_in, -1).T))
    q, state = bnb.quantize_4bit(t, blocksize=64, quant_type="nf4")
    return bnb.dequantize_4bit(q, state).numpy().T.reshape(w.shape)


def int8_closed_form(w: np.ndarray, n_in: int) -> np.ndarray:
    """Symmetric int8 with a scale per output channel: absmax over the inputs maps to 127.5, rounded, clipped
    to [-128, 127]. Where a weight sits on a half step (the absmax always does), Qwix's product with the
    scale's reciprocal may land either side: there the closed form gives NaN, for either neighbour."""
    scale = np.abs(w).max(axis=tuple(range(n_in)), keepdims=True) / np.float32(127.5)
    steps = w / scale
    half = np.abs(np.abs(steps - np.floor(steps)) - 0.5) < 1e-4
    return np.where(half, np.nan, np.clip(np.round(steps), -128, 127) * scale), np.broadcast_to(scale, w.shape)


def nf4(w: np.ndarray, n_in: int):
    return bnb_nf4(w, n_in), None


def test_the_quantised_base_is_bitsandbytes_nf4_and_the_adapted_model_is_the_float_model_on_it(base_run):
    _, _, floats = load_params(micro_config(model=SHAPE), base_run)
    floats = jax.tree.map(np.asarray, floats)
    for scheme, reference in (("nf4", nf4), ("int8", int8_closed_form)):
        cfg = qlora(scheme, checkpoint={"init_from": base_run})
        setup = build(cfg)  # 8 devices: the weights quantised into their fsdp shards
        base, _, _ = load_init_params(cfg, setup)
        restored = jax.tree.map(np.asarray, quantised.dequantised(base))
        want = {}
        for block in ("attn", "mlp"):
            for name, value in floats["layers"][block].items():
                if name in LAYOUT:
                    layers = [reference(layer, LAYOUT[name]) for layer in value]
                    want[name] = np.stack([x for x, _ in layers])
                    got, exact = restored["layers"][block][name], ~np.isnan(want[name])
                    np.testing.assert_allclose(got[exact], want[name][exact], rtol=0, atol=1e-7)
                    if scheme == "int8":  # on a half step: the step below or above
                        steps = (value / np.stack([s for _, s in layers]))[~exact]
                        held = got[~exact] / np.stack([s for _, s in layers])[~exact]
                        assert np.all(np.isclose(held, np.floor(steps)) | np.isclose(held, np.ceil(steps)))
                        assert exact.mean() > 0.99
                    want[name][~exact] = got[~exact]
        # The model reads the quantised weights inside its layer scan: logits with adapters (B given values)
        # equal the float model applied to the reference's dequantised weights with the adapters folded in.
        spec = ModelSpec.from_config(cfg)
        added = jax.tree.map(lambda a: jax.random.normal(jax.random.key(a.size), a.shape) * 0.05,
                             adapters.split(setup.model.abstract_params)[0])  # fmt: skip
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 16)), jnp.int32)
        logits = jax.jit(setup.model.apply)(adapters.join(added, base), tokens)
        plain = jax.tree.map(lambda x: x, floats)
        for block in ("attn", "mlp"):
            plain["layers"][block].update({k: v for k, v in want.items() if k in plain["layers"][block]})
        folded = adapters.fold(adapters.join(jax.device_get(added), plain), spec.arch.lora.alpha / spec.arch.lora.rank)
        float_model = ModelDef.create(ModelSpec.from_config(micro_config(model=SHAPE)), setup.shard)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(jax.jit(float_model.apply)(folded, tokens)),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.slow  # a QLoRA run stopped, resumed and planned, 22 s (2026-12-06): room for the suite's 10 minutes
def test_a_qlora_run_trains_its_adapters_keeps_the_base_bits_resumes_exactly_and_plans_its_bytes(base_run, tmp_path):
    cfg = qlora("nf4", train=dict(steps=4, log_every=1), checkpoint={"every_steps": 2, "init_from": base_run})
    straight = train(cfg, str(tmp_path / "straight"))
    first = qlora("nf4", train=dict(steps=2, log_every=1), checkpoint={"every_steps": 2, "init_from": base_run})
    train(first, str(tmp_path / "resumed"))
    resumed = train(cfg, str(tmp_path / "resumed"))
    for name in ("loss", "grad_norm", "param_norm"):
        assert resumed[name] == pytest.approx(straight[name], rel=1e-6), name
    setup, _, weights = load_params(cfg, str(tmp_path / "straight"))
    added, base = adapters.split(weights)
    fresh, _, _ = load_init_params(cfg, setup)  # the base quantised again from init_from: the same bits
    for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert min(float(jnp.max(jnp.abs(b["b"]))) for b in added["layers"]["attn"].values()) > 0

    # The planner holds the base at its stored bytes, per device of 8 (fsdp over the model dimension): each
    # projection at half a byte a weight; an fp32 scale per 64 inputs, sharded only where its outputs are
    # (wo's and w_down's: the model dimension); the embedding, head and norms in fp32.
    a = cfg.model
    d, n, k, h, f, vocab = a.d_model, a.n_heads, a.n_kv_heads, a.d_model // a.n_heads, a.d_ff, a.vocab_size
    projections = (d * h * (n + 2 * k) + n * h * d + 3 * d * f) // 2 // 8
    scales = 4 * (d // 64 * h * (n + 2 * k) + n * (h // 64) * d // 8 + 2 * (d // 64) * f + (f // 64) * d // 8)
    want = a.n_layers * (projections + scales + 2 * 4 * d // 8) + 2 * vocab * d * 4 // 8 + 4 * d // 8
    assert state_bytes(setup)["frozen"] == want


def test_a_hybrids_linear_layers_quantise_as_bitsandbytes_and_adapt_on_that_base():
    """A Gated DeltaNet layer's every projection (in_proj_qkv's q, k and v, in_proj_z, in_proj_b, in_proj_a,
    out_proj) and the full-attention layer's gate are quantised as bitsandbytes' nf4 quantises the torch
    Linear each is (value heads of 64, so out_proj's blocks are bitsandbytes' too); the adapted model on that
    base gives the float model's logits on the dequantised weights with the adapters folded in."""
    hybrid = {**HYBRID, "linear": dict(key_heads=2, value_heads=2, key_dim=16, value_dim=64)}
    cfg = micro_config(model=hybrid, checkpoint={"init_from": "unread"})
    cfg.model.lora.update(rank=4, alpha=8.0, base="nf4")
    setup = build(cfg)
    float_spec = ModelSpec.from_config(micro_config(model=hybrid))
    floats = jax.device_get(init_params(float_spec, setup.shard, 0))
    added = adapters.split(setup.model.abstract_params)[0]
    base = quantised.quantise_tree(floats, frozen(abstract_params(setup.model, setup.shard), setup.model))
    restored = jax.tree.map(np.asarray, quantised.dequantised(base))
    want = jax.tree.map(lambda x: x, restored)  # the rest (the MLPs, attention's q, k, v, o) checked above
    inputs = {"wq": 1, "wk": 1, "wv": 1, "wz": 1, "wb": 1, "wa": 1, "wo": 2, "wg": 1}
    for stack, names in (("linear_layers", ("wq", "wk", "wv", "wz", "wb", "wa", "wo")), ("layers", ("wg",))):
        for name in names:
            value = floats[stack]["attn"][name]
            want[stack]["attn"][name] = np.stack([bnb_nf4(layer, inputs[name]) for layer in value])
            np.testing.assert_allclose(restored[stack]["attn"][name], want[stack]["attn"][name], rtol=0, atol=1e-7)
    added = jax.tree.map(lambda a: jax.random.normal(jax.random.key(a.size), a.shape) * 0.05, added)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 384, (2, 16)), jnp.int32)
    logits = jax.jit(setup.model.apply)(adapters.join(added, base), tokens)
    folded = adapters.fold(adapters.join(jax.device_get(added), want), 2.0)
    float_model = ModelDef.create(float_spec, setup.shard)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(jax.jit(float_model.apply)(folded, tokens)), rtol=1e-4,
                               atol=1e-4)  # fmt: skip
