"""Low-rank adapters (model.lora): the adapted forward against numpy and against the base with the adapters
folded in; the base frozen (never in the state, the optimiser or a checkpoint, its bits unchanged); a LoRA
step the same on 8 devices as on 1; exact resume; and the refusals, before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HYBRID, micro_config
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.config import ADAPTER_TARGETS
from trainer.config.errors import ConfigError
from trainer.model import adapters
from trainer.model.decoder import ModelDef, init_params
from trainer.model.primitives import MLP
from trainer.model.spec import ModelSpec
from trainer.run.loop import train
from trainer.training.resume import load_params
from trainer.training.setup import build

NO_MESH = LogicalSharding.create(None)


def adapted(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"), lora_dropout=0.0, **sections):
    cfg = micro_config(**sections)
    cfg.model.lora.update(rank=rank, alpha=alpha, targets=targets, dropout=lora_dropout)
    return cfg


def test_an_adapted_mlp_is_its_base_plus_alpha_over_rank_times_x_a_b_in_numpy():
    spec = ModelSpec.from_config(adapted(targets=("gate", "up", "down")))
    mlp = MLP(spec, NO_MESH, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for name in ("gate", "up", "down"):  # B starts at zero: give it values, so the update shows
        adapter = getattr(mlp, f"lora_{name}")
        adapter.b.value = jnp.asarray(rng.normal(0, 0.1, adapter.b.value.shape), jnp.float32)
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    w = {name: np.asarray(getattr(mlp, f"w_{name}").value) for name in ("gate", "up", "down")}
    a = {name: np.asarray(getattr(mlp, f"lora_{name}").a.value) for name in ("gate", "up", "down")}
    b = {name: np.asarray(getattr(mlp, f"lora_{name}").b.value) for name in ("gate", "up", "down")}
    scale = 8.0 / 4

    def project(name, v):
        return v @ w[name] + scale * (v @ a[name]) @ b[name]

    gate, up = project("gate", x), project("up", x)
    hidden = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), project("down", hidden), rtol=2e-5, atol=2e-6)

    # With a training step's key and model.lora.dropout=0.25, each adapter's input (not the weight's) is
    # dropped, the rest scaled by 1 / 0.75. The masks are the key's: drawn here as the layer draws them.
    dropped = MLP(ModelSpec.from_config(adapted(targets=("gate", "up", "down"), lora_dropout=0.25)), NO_MESH,
                  nnx.Rngs(0))  # fmt: skip
    nnx.update(dropped, nnx.state(mlp))
    key = jax.random.key(7)

    def masked(name, v):
        index = ("q", "k", "v", "o", "gate", "up", "down").index(name)
        keep = np.asarray(jax.random.bernoulli(jax.random.fold_in(key, index), 0.75, v.shape))
        assert 0.6 < keep.mean() < 0.9
        return v @ w[name] + scale * ((v * keep / 0.75) @ a[name]) @ b[name]

    gate, up = masked("gate", x), masked("up", x)
    hidden = gate / (1 + np.exp(-gate)) * up
    np.testing.assert_allclose(np.asarray(dropped(jnp.asarray(x), key)), masked("down", hidden), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dropped(jnp.asarray(x))), np.asarray(mlp(jnp.asarray(x))), rtol=1e-6)


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "hybrid"])
def test_the_adapted_model_starts_as_its_base_and_equals_it_with_the_adapters_folded_in(hybrid):
    """On a hybrid, every target: the full-attention layer's q adapter covers its gate as q_proj does, and the
    Gated DeltaNet layer's qkv (one A for q, k and v), z and out."""
    model = HYBRID if hybrid else {}
    cfg = adapted(targets=ADAPTER_TARGETS, model=model)
    spec, base_spec = ModelSpec.from_config(cfg), ModelSpec.from_config(micro_config(model=model))
    params = init_params(spec, NO_MESH, 0)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 384, (2, 16)), jnp.int32)
    model, base_model = ModelDef.create(spec, NO_MESH), ModelDef.create(base_spec, NO_MESH)
    apply, apply_base = jax.jit(model.apply), jax.jit(base_model.apply)
    added, base = adapters.split(params)
    linear = {"qkv", "z", "out"} if hybrid else set()
    assert set(adapters.count(params)) == {"q", "k", "v", "o", "gate", "up", "down"} | linear
    # B = 0: the base's logits; bit for bit on a Llama, to rounding on a hybrid (its rule compiles otherwise)
    np.testing.assert_allclose(apply(params, tokens), apply_base(base, tokens), rtol=0, atol=1e-6 if hybrid else 0)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(added))))
    added = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), added)
    moved = adapters.join(added, base)
    folded = adapters.fold(moved, cfg.model.lora.alpha / cfg.model.lora.rank)
    assert jax.tree.structure(folded) == jax.tree.structure(base)
    logits, reference = apply(moved, tokens), apply_base(folded, tokens)
    assert float(jnp.max(jnp.abs(logits - apply_base(base, tokens)))) > 1e-2  # the adapters do something
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 4-step run whose weights the adapters adapt."""
    path = str(tmp_path_factory.mktemp("base") / "run")
    train(micro_config(train=dict(steps=4), checkpoint={"every_steps": 4}), path)
    return path


def test_only_the_adapters_train_and_checkpoint_and_the_base_stays_bit_for_bit(base_run, tmp_path):
    cfg = adapted(train=dict(steps=6, log_every=1), checkpoint={"every_steps": 6, "init_from": base_run})
    setup = build(cfg)
    state = setup.abstract_state()
    n_adapters = sum(x.size for x in jax.tree.leaves(state.params))
    assert all("lora_" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params))
    # AdamW's two moments over the adapters alone: the base is never copied into the optimiser.
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_adapters
    total = sum(x.size for x in jax.tree.leaves(setup.model.abstract_params))
    assert n_adapters / (total - n_adapters) < 0.15  # 13.7% on this 0.1M-parameter model; 0.2% at 8B
    result = train(cfg, str(tmp_path / "lora"))
    assert result["step"] == 6 and np.isfinite(result["loss"])
    _, _, trained_weights = load_params(cfg, str(tmp_path / "lora"))
    _, _, base_weights = load_params(micro_config(), base_run)
    added, base = adapters.split(trained_weights)
    for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(base_weights), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    moved = [float(jnp.max(jnp.abs(b))) for p, b in jax.tree_util.tree_leaves_with_path(added)
             if jax.tree_util.keystr(p).endswith("['b']")]  # fmt: skip
    assert len(moved) == 7 and min(moved) > 0  # every B (zero at the start) trained, in the scanned stack


MOE = dict(num_experts=4, experts_per_token=2, shared_experts=1)


SPLIT_RANK = dict(data=2, fsdp=2, tensor=2, rules=dict(lora=("fsdp",)))


@pytest.mark.parametrize(("mesh", "moe", "dropout"), [(SPLIT_RANK, {}, 0.0),
                                                      (dict(data=2, fsdp=2, expert=2), MOE, 0.25)],
                         ids=["data-fsdp-tensor", "experts-dropout"])  # fmt: skip
def test_a_lora_step_on_8_devices_equals_one_device_and_the_base_input_is_untouched(base_run, mesh, moe, dropout):
    """Dense, with each adapter's rank split over fsdp (mesh.rules.lora=fsdp: B is sharded, not whole on every
    device), and a mixture with shared experts (their gate, up and down adapted) over mesh.expert with the
    adapters' dropout on: the masks are drawn over the whole batch, so the mesh does not change them."""
    one, eight = (build(adapted(checkpoint={"init_from": base_run}, mesh=m, model=dict(moe=moe), lora_dropout=dropout),
                        devices) for m, devices in ((dict(fsdp=1), jax.devices()[:1]), (mesh, None)))  # fmt: skip
    batch = {k: np.asarray(np.random.default_rng(3).integers(0, 384, (8, 32)), np.int32)
             for k in ("tokens",)}  # fmt: skip
    batch.update(positions=np.tile(np.arange(32, dtype=np.int32), (8, 1)), segment_ids=np.ones((8, 32), np.int32))
    results = []
    for setup in (one, eight):
        base = jax.tree.map(lambda a: jax.device_put(_noise(a.shape), a.sharding), setup.step_inputs()[0])
        before = jax.tree.map(np.asarray, base)
        state, step, losses = setup.new_state(), setup.train_step(), []
        placed = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
        for _ in range(3):
            state, metrics = step(state, placed, base)
            losses.append(float(metrics["loss"]))
        for got, want in zip(jax.tree.leaves(base), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)  # an input, never donated or changed
        results.append((losses, jax.tree.map(np.asarray, state.params)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    assert results[0][0][-1] < results[0][0][0]
    for got, want in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[0][1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _noise(shape) -> np.ndarray:
    return np.random.default_rng(int(np.prod(shape))).normal(0, 0.05, shape).astype(np.float32)


@pytest.mark.slow  # a stopped and resumed LoRA run, 22 s (2026-12-06): room for the suite's 10 minutes
def test_a_lora_run_with_dropout_resumes_exactly(base_run, tmp_path):
    """With the adapters' dropout on (its masks from the seed, step and microbatch) and two microbatches."""

    def run(steps, dropout, name):
        steps = dict(steps=steps, log_every=1, grad_accum_steps=2, global_batch_size=16)
        cfg = adapted(lora_dropout=dropout, train=steps, checkpoint={"every_steps": 2, "init_from": base_run})
        return train(cfg, str(tmp_path / name))

    straight = run(4, 0.1, "straight")
    assert run(2, 0.1, "resumed")["step"] == 2
    # A resume that names another start is refused, the run untouched: a started run keeps its base (pinned at
    # its start as DIR@STEP), where this one would otherwise have trained on without a word. Its own DIR again,
    # without the step, is its start.
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "resumed").rglob("*"))
    other = adapted(lora_dropout=0.1, train=dict(steps=4, log_every=1, grad_accum_steps=2, global_batch_size=16),
                    checkpoint={"every_steps": 2, "init_from": str(tmp_path / "straight")})  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'resumed'} started from checkpoint.init_from='{base_run}@4' "
                                          rf"\(its config.json\); a run keeps the weights it started from, so "
                                          rf"checkpoint.init_from='{tmp_path / 'straight'}' would not be read: resume "
                                          rf"with --config {tmp_path / 'resumed'}/config.json, or start a new run "
                                          rf"from it with another --workdir.$"):  # fmt: skip
        train(other, str(tmp_path / "resumed"))
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "resumed").rglob("*")) == files
    resumed = run(4, 0.1, "resumed")
    for name in ("loss", "grad_norm", "param_norm"):
        assert resumed[name] == pytest.approx(straight[name], rel=1e-6), name
    without = run(4, 0.0, "without")
    assert abs(without["grad_norm"] - straight["grad_norm"]) > 1e-4 * straight["grad_norm"]  # dropout did act


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (dict(rank=-1), "model.lora.rank=-1"),
        (
            dict(targets=("q", "query")),
            "names query; the projections that take adapters: q,k,v,o,gate,up,down,qkv,z,out",
        ),
        (dict(base="int4"), "model.lora.base='int4' is not one of"),
        (dict(init_from=""), "give them with --config.checkpoint.init_from"),
        (dict(stage=2), "adapters do not run through pipeline stages"),
        (
            dict(moe=True, targets=("q", "k", "v", "o", "gate", "up", "down")),
            "names gate,up,down, which this model has none of; the projections it adapts: q,k,v,o",
        ),
        (dict(targets=("qkv", "o")), "names qkv, which this model has none of; the projections it adapts: o ("),
        (dict(base="nf4", d_ff=129), "packs two 4-bit values a byte along w_down's inputs, which number 129"),
        (dict(base="int8", rank=0), "model.lora.base=int8 quantises the frozen base beside adapters (QLoRA); set"),
        (dict(rank=3, lora_rule=True), "model.lora.rank=3 does not divide over mesh.fsdp=2 (mesh.rules.lora splits"),
    ],
)
def test_bad_adapter_settings_are_one_sentence_before_anything_compiles(changes, says):
    cfg = adapted(checkpoint={"init_from": "somewhere"})
    for key in ("rank", "targets", "base"):
        if key in changes:
            cfg.model.lora[key] = changes[key]
    if "init_from" in changes:
        cfg.checkpoint.init_from = ""
    if "stage" in changes:
        cfg.mesh.update(stage=2, fsdp=1, data=1)
        cfg.train.pipeline_microbatches = 2
    if "moe" in changes:
        cfg.model.moe.update(num_experts=4, experts_per_token=2)
    if "d_ff" in changes:
        cfg.model.d_ff = changes["d_ff"]
    if "lora_rule" in changes:
        cfg.mesh.update(fsdp=2, data=-1)
        cfg.mesh.rules.lora = ("fsdp",)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        build(cfg)


def test_a_peft_adapter_missing_a_tensor_or_of_another_shape_is_one_sentence():
    """PEFT's tensors of our adapters come back as they went; one missing, or one of another rank or model
    width, is a sentence naming it."""
    from trainer.interop import peft

    spec = ModelSpec.from_config(adapted())
    added = adapters.split(init_params(spec, NO_MESH, 0))[0]
    added = jax.tree.map(lambda x: np.asarray(x) + 0.1, added)  # B too: not all zeros
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), added)
    tensors = peft.to_peft(added, spec.arch)
    back = peft.from_peft(tensors, abstract, spec.arch)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(added), strict=True):
        np.testing.assert_array_equal(got, want)
    key = next(k for k in tensors if k.endswith("self_attn.v_proj.lora_A.weight"))
    with pytest.raises(ConfigError, match=f"the adapter has no {key.replace('.', '[.]')}; it was trained for other"):
        peft.from_peft({k: v for k, v in tensors.items() if k != key}, abstract, spec.arch)
    wider = {**tensors, key: np.zeros((tensors[key].shape[0] * 2, tensors[key].shape[1]), np.float32)}
    with pytest.raises(ConfigError, match=r"is \(8, 64\), where this config's model and rank make \(4, 64\)"):
        peft.from_peft(wider, abstract, spec.arch)
