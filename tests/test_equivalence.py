"""The equivalence matrix: a mesh changes speed and memory, never the mathematics.

20 steps of real training (stdlib text, the loss falls from 6.0 to 3.2) under
each mesh, with and without gradient accumulation, against one device. fp32
summation order differs between layouts and Adam amplifies it; measured here:
losses within 1.5e-5 (relative) and parameters within 4.2e-4 (relative norm per
array), where summing the same gradient in two halves on one device already
moves them 8e-5. The tolerances sit well below what a real change does: a
learning rate 0.1% higher moves the losses 3.7e-3 and the parameters 9.5e-2,
and a test below checks that it fails them.
"""

import jax
import numpy as np
import pytest
from conftest import micro_config

from trainer.training.setup import build

STEPS = 20
LOSS_RTOL, PARAM_RTOL = 1e-4, 2e-3


def config(mesh=None, accum=1, sequence_parallel=False, lr=1e-2):
    return micro_config(
        model=dict(n_heads=8, n_kv_heads=4),  # kv heads divisible by tensor=4
        mesh=dict(**(mesh or dict(fsdp=1)), sequence_parallel=sequence_parallel),
        train=dict(global_batch_size=16, grad_accum_steps=accum, steps=STEPS),
        optim=dict(lr=lr, warmup_steps=2),
    )


def run(cfg, n_devices, batches):
    setup = build(cfg, jax.devices()[:n_devices])
    state, step = setup.new_state(), setup.train_step()
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.fixture(scope="module")
def one_device(text_batches):
    return run(config(), 1, text_batches)


def differences(result, reference):
    (losses, params), (ref_losses, ref_params) = result, reference
    loss_diff = float(np.max(np.abs(losses - ref_losses) / ref_losses))
    param_diff = max(
        float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))  # an all-zero array (an unmoved bias): equal
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
    )
    return loss_diff, param_diff


MESHES = {  # each layout once (pure data parallelism: tests/test_multiprocess.py); accumulation on three
    "fsdp=8, accumulation": (dict(fsdp=8), 2),
    "tensor=4 x data=2, accumulation": (dict(data=2, fsdp=1, tensor=4), 2),
    "data=2 x fsdp=2 x tensor=2": (dict(data=2, fsdp=2, tensor=2), 1),
    "fsdp=4 x tensor=2, accumulation": (dict(fsdp=4, tensor=2), 2),
}


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_trains_like_one_device(mesh, one_device, text_batches):
    losses, _ = one_device
    assert losses[-1] < losses[0] - 2.0  # real training, not a flat line
    layout, accum = MESHES[mesh]
    loss_diff, param_diff = differences(run(config(layout, accum), 8, text_batches), one_device)
    assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (loss_diff, param_diff)


def test_sequence_parallelism_trains_like_one_device(one_device, text_batches):
    result = run(config(dict(fsdp=4, tensor=2), sequence_parallel=True), 8, text_batches)
    loss_diff, param_diff = differences(result, one_device)
    assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (loss_diff, param_diff)


def test_the_tolerances_catch_a_real_change(one_device, text_batches):
    loss_diff, param_diff = differences(run(config(lr=1e-2 * 1.001), 1, text_batches), one_device)
    assert loss_diff > 10 * LOSS_RTOL and param_diff > 10 * PARAM_RTOL, (loss_diff, param_diff)


FAMILIES = {  # the model families' layers (docs/model_families.md) at micro size
    "gemma3": dict(sliding_window=8, global_every=2, local_rope_theta=1000.0, rope_theta=1e6, embed_scale=True,
                   post_norms=True, mlp_activation="gelu_tanh", qk_norm=True, attn_scale_dim=12),
    "deepseek_v3": dict(mla=dict(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=8, v_dim=12), mtp=dict(depth=1),
                        moe=dict(num_experts=4, experts_per_token=2, shared_experts=1, d_ff=64, dense_layers=1,
                                 router="sigmoid", routed_scale=2.0, groups=2, groups_per_token=1)),
    "qwen3_5": dict(layer_types=("linear_attention", "full_attention"), qk_norm=True, attention_gate=True,
                    rope_fraction=0.5, linear=dict(key_heads=4, value_heads=8, key_dim=8, value_dim=8)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_families_train_on_a_mesh_like_one_device(family, text_batches):
    """Gemma 3's local and global layers (a window of 8 over 32 tokens), DeepSeek-V3's latent attention,
    sigmoid-routed experts and multi-token prediction, and Qwen3.5's Gated DeltaNet beside gated attention
    (its heads over tensor as attention's): 10 steps on data 2 x fsdp 2 x tensor 2 (heads, MLP
    and expert widths over tensor; the latents whole) against one device, within the matrix's tolerances."""
    model = {**FAMILIES[family], "n_heads": 8, "n_kv_heads": 8 if family == "deepseek_v3" else 4}

    def family_config(mesh):
        cfg = config(mesh)
        cfg.model.update({k: v for k, v in model.items() if not isinstance(v, dict)})
        for group in ("mla", "mtp", "moe", "linear"):
            cfg.model[group].update(model.get(group, {}))
        return cfg

    batches = text_batches[:10]
    one = run(family_config(None), 1, batches)
    assert one[0][-1] < one[0][0] - 1.0
    loss_diff, param_diff = differences(run(family_config(dict(data=2, fsdp=2, tensor=2)), 8, batches), one)
    assert loss_diff < LOSS_RTOL and param_diff < PARAM_RTOL, (loss_diff, param_diff)
