"""Pipeline parallelism: stages change where layers run, never the mathematics.

The reference is the same 4-layer model trained on one device with no stages,
on real text (the loss falls from 6.0 to 3.3 in 20 steps). Tolerances are the
equivalence matrix's (tests/test_equivalence.py): fp32 summation order differs
between layouts and Adam amplifies it; measured for the pipelines below:
losses within 5e-6 (relative) and parameters within 2.1e-4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import micro_config
from flax import nnx
from test_equivalence import LOSS_RTOL, PARAM_RTOL, differences, run

from parallelism import collectives
from trainer.config.errors import ConfigError
from trainer.data import streams
from trainer.model.decoder import Decoder
from trainer.model.spec import Architecture, Execution, ModelSpec
from trainer.storage.checkpoint import Checkpointer
from trainer.training.resume import restore_state
from trainer.training.setup import build
from trainer.training.step import BATCH_KEYS

STEPS = 20


def config(mesh=None, microbatches=1, accum=1, remat="none"):
    return micro_config(
        model=dict(n_layers=4, n_heads=8, n_kv_heads=4, remat=remat),
        mesh=mesh or dict(fsdp=1),
        train=dict(global_batch_size=16, grad_accum_steps=accum, pipeline_microbatches=microbatches, steps=STEPS),
        optim=dict(lr=1e-2, warmup_steps=2),
    )


@pytest.fixture(scope="module")
def one_stage(text_batches):
    return run(config(), 1, text_batches)


def test_pipelined_forward_equals_the_plain_layer_scan():
    arch = Architecture(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64)
    spec = ModelSpec(arch)
    plain = Decoder(spec, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, 128)
    # Two packed documents per row: positions and segment ids must travel with their microbatch.
    segments = jnp.repeat(jnp.array([[1] * 8 + [2] * 8]), 8, axis=0)
    positions = jnp.repeat(jnp.array([list(range(8)) * 2]), 8, axis=0)
    expected = plain(tokens, positions, segments)
    for stages, microbatches in [(2, 2), (2, 8), (4, 4)]:
        piped = Decoder(ModelSpec(arch, Execution(stages=stages, pipeline_microbatches=microbatches)), rngs=nnx.Rngs(0))
        np.testing.assert_allclose(piped(tokens, positions, segments), expected, atol=2e-6, rtol=0)


PIPELINES = {
    "stage=4 x data=2, remat": (dict(stage=4, data=2, fsdp=1), 4, 1, "full", 8),
    "stage=2 x fsdp=2 x tensor=2, accumulation": (dict(stage=2, fsdp=2, tensor=2), 2, 2, "save_dots", 8),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_pipelines_train_like_one_stage(name, one_stage, text_batches):
    mesh, microbatches, accum, remat, n_devices = PIPELINES[name]
    result = run(config(mesh, microbatches, accum, remat), n_devices, text_batches)
    loss_diff, param_diff = differences(result, one_stage)
    assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (loss_diff, param_diff)


def test_each_stage_holds_its_own_layers_and_passes_activations_to_its_neighbour():
    setup = build(config(dict(stage=4, data=2, fsdp=1), microbatches=4))
    state = setup.new_state()
    w = state.params["layers"]["mlp"]["w_up"]  # (layers, embed, mlp)
    assert {s.data.shape[0] for s in w.addressable_shards} == {1}  # 4 layers over 4 stages
    batch = {k: jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=setup.batch_sharding) for k in BATCH_KEYS}
    found = collectives.parse(setup.train_step().lower(setup.abstract_state(), batch).compile().as_text())
    # Activations (and tokens, segment ids, positions) go to the next stage forward and gradients
    # to the previous one backward: one (microbatch rows, seq, d_model) fp32 array per tick at least.
    assert found["collective-permute"]["bytes"] >= 2 * (4 + 4 - 1) * (16 // 4 // 2) * 32 * 64 * 4, found
    # With fsdp=1 nothing gathers weights, synchronously or not: each stage holds its own layers.
    assert "all-gather" not in found and "reduce-scatter" not in found, found


@pytest.mark.parametrize("saved,restored", [(2, 1)], ids=["stage2->stage1"])
def test_a_checkpoint_restores_across_stage_counts(tmp_path, saved, restored):
    def setup_for(stages):
        cfg = config(dict(stage=stages, fsdp=2), microbatches=2 * stages if stages > 1 else 1)
        return cfg, build(cfg, jax.devices()[: 2 * stages])

    cfg, source = setup_for(saved)
    data = iter(streams.batches(streams.Stream.from_config(cfg), "train", range(16), shuffle=True))
    state, step = source.new_state(), source.train_step()
    for _ in range(2):
        state, _ = step(state, next(data))
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, async_save=False)
    ckpt.save(2, state, data)
    upcoming = next(data)

    target_cfg, target = setup_for(restored)
    fresh = iter(streams.batches(streams.Stream.from_config(target_cfg), "train", range(16), shuffle=True))
    back, *_ = restore_state(ckpt, 2, target, fresh)
    ckpt.close()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
    batch = next(fresh)
    np.testing.assert_array_equal(batch["tokens"], upcoming["tokens"])
    _, here = step(state, upcoming)
    _, there = target.train_step()(back, batch)
    np.testing.assert_allclose(float(there["loss"]), float(here["loss"]), rtol=1e-5)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(mesh=dict(stage=3)), r"model.n_layers=4 does not split into mesh.stage=3"),
        (dict(mesh=dict(stage=4), microbatches=2), r"train.pipeline_microbatches=2 is fewer than mesh.stage=4"),
        (
            dict(mesh=dict(stage=2), microbatches=3),
            r"16 sequences .* does not split into train.pipeline_microbatches=3",
        ),
        (dict(mesh=dict(stage=2, data=2, fsdp=1), microbatches=16), r"pipeline microbatch of 1 sequences"),
        (dict(mesh=dict(stage=1), microbatches=4), r"train.pipeline_microbatches=4 only applies to a pipeline"),
    ],
)
def test_pipeline_misfits_are_refused_before_compiling(overrides, message):
    cfg = config(overrides["mesh"] | ({"fsdp": 1} if "fsdp" not in overrides["mesh"] else {}),
                 microbatches=overrides.get("microbatches", 4))  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        build(cfg, jax.devices()[: cfg.mesh.stage * cfg.mesh.data])


def test_the_plan_gives_the_bubble_and_what_each_stage_holds():
    from trainer.planning.plan import plan

    result = plan(config(dict(stage=4, fsdp=1), microbatches=4), compile_step=False, devices=jax.devices()[:4])
    piped = result["pipeline"]
    assert piped["bubble_fraction"] == pytest.approx(3 / 7)
    params = build(config(), jax.devices()[:1]).model.abstract_params
    layers = sum(a.size * 4 for a in jax.tree.leaves(params["layers"]))
    rest = sum(a.size * 4 for a in jax.tree.leaves(params)) - layers
    assert piped["state_bytes_per_device"]["params"] == layers // 4 + rest
