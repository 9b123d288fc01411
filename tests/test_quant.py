"""Quantised training's matmuls (model.quant, trainer/model/low_precision.py): their arithmetic against the
closed form of their scales, a quantised step on a mesh against one device, the TPU compiler's dots, and the
refusals."""

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import micro_config

from parallelism import hlo
from trainer.config.errors import ConfigError
from trainer.model.low_precision import einsum
from trainer.model.spec import Execution
from trainer.planning.targets import installed, parse_target, target_devices
from trainer.run.loop import train
from trainer.storage import compile_cache
from trainer.training.setup import build
from trainer.training.validation import validate

KINDS = {"int8": (np.int8, np.int8), "fp8": (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)}


def _planted(rng, shape, scale) -> np.ndarray:
    """Normal values, with each row's and each column's largest magnitude a positive one: a value at exactly
    the top of the int8 range (absmax / scale = 127.5) rounds the same whatever the order of operations."""
    a = rng.normal(size=shape).astype(np.float32) * scale
    for i in range(max(shape)):
        a[i % shape[0], i % shape[1]] = 4 * scale * (1 + 0.01 * i)
    return a


def _quantised(a: np.ndarray, axis: int, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(values, scale): absmax over `axis` onto the type's symmetric range (127.5 for int8, as Qwix: its top
    bucket is whole), rounded to the nearest (int8) or cast (fp8)."""
    top = 127.5 if qtype is np.int8 else float(ml_dtypes.finfo(qtype).max)
    scale = np.abs(a).max(axis=axis, keepdims=True) / np.float32(top)
    if qtype is np.int8:
        return np.clip(np.round(a / scale), -128, 127), scale
    return (a / scale).astype(qtype).astype(np.float32), scale


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantised_matmul_and_its_gradients_are_the_closed_form_of_their_scales(kind):
    """y = x w forward, and both gradients, each equal to the documented arithmetic written out in numpy:
    forward operands quantised per channel (x per row, w per output column), their integer (or fp8) product
    rescaled; backward the incoming gradient quantised per channel after taking the other operand's scale
    onto it, times that operand's quantised values."""
    rng = np.random.default_rng(0)
    x, w, g = _planted(rng, (6, 16), 1.0), _planted(rng, (16, 12), 0.1), _planted(rng, (6, 12), 1.0)
    forward, backward = KINDS[kind]
    run = Execution(quant_matmul=kind, quant_targets=("mlp",))
    y, vjp = jax.vjp(lambda x, w: einsum("nd,df->nf", x, w, run, "mlp"), x, w)
    dx, dw = vjp(g)
    xq, sx = _quantised(x, 1, forward)
    wq, sw = _quantised(w, 0, forward)
    np.testing.assert_allclose(y, (xq @ wq) * sx * sw, rtol=1e-5, atol=1e-6)
    gq, sg = _quantised(g * sw, 1, backward)
    np.testing.assert_allclose(dx, (gq @ wq.T) * sg, rtol=1e-5, atol=1e-6)
    gq, sg = _quantised(g * sx, 0, backward)
    np.testing.assert_allclose(dw, (xq.T @ gq) * sg, rtol=1e-5, atol=1e-5)
    plain = x @ w  # and it is a quantisation of the float product, not another function
    assert 0 < np.abs(np.asarray(y) - plain).max() < 0.05 * np.abs(plain).max()
    untargeted = einsum("nd,df->nf", x, w, run, "attention")  # a matmul not named in the targets
    np.testing.assert_allclose(untargeted, plain, rtol=1e-5)  # float32 sums in XLA's order, not numpy's


def test_an_int8_step_on_8_devices_equals_one_device_and_the_state_stays_fp32():
    """Three int8 steps (attention, MLP and logits quantised) on data 2 x fsdp 2 x tensor 2 and on one
    device. Each channel's absmax is a maximum over the whole contraction however the mesh splits it and int32
    sums add exactly, but the float inputs of a quantisation differ in their last bits between the two (sums
    in another order), and a value on a rounding boundary then lands a step apart: the tolerance is that of
    such flips, not of float rounding. The master weights and the optimiser's state stay fp32."""
    quant = dict(quant=dict(matmul="int8", targets=("attention", "mlp", "logits")))
    meshes = ((dict(fsdp=1), jax.devices()[:1]), (dict(data=2, fsdp=2, tensor=2), None))
    setups = [build(micro_config(model=quant, mesh=mesh, optim=dict(name="sgd", lr=0.1)), devices)
              for mesh, devices in meshes]  # fmt: skip
    tokens = np.random.default_rng(3).integers(0, 384, (8, 32)).astype(np.int32)
    batch = {"tokens": tokens, "positions": np.tile(np.arange(32, dtype=np.int32), (8, 1)),
             "segment_ids": np.ones((8, 32), np.int32)}  # fmt: skip
    results = []
    for setup in setups:
        state, step, losses = setup.new_state(), setup.train_step(), []
        placed = {k: jax.device_put(v, setup.batch_sharding) for k, v in batch.items()}
        for _ in range(3):
            state, metrics = step(state, placed)
            losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim} == {np.dtype("float32")}
        results.append((np.array(losses), jax.tree.map(np.asarray, state.params)))
    # Measured here: losses within 2e-5, gradient norms 8e-4, weights 7e-5 (by SGD at lr 0.1: Adam would move a
    # near-zero gradient's weight by ~lr whichever way a flipped rounding tips its sign).
    np.testing.assert_allclose(results[1][0][:, 0], results[0][0][:, 0], rtol=1e-4)
    np.testing.assert_allclose(results[1][0][:, 1], results[0][0][:, 1], rtol=2e-3)
    assert results[0][0][-1, 0] < results[0][0][0, 0]
    for got, want in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[0][1]), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4)


needs_libtpu = pytest.mark.skipif(not installed("libtpu"), reason='pip install -e ".[tpu]"')


def _dots(cfg, target: str) -> list[tuple[str, list[str]]]:
    """The compiled step's dots and convolutions for `target` (XLA:TPU through libtpu, no TPU needed): each
    as (its first operand's element type, its operands' shapes)."""
    setup = build(cfg, target_devices(parse_target(target)))
    lowered = setup.train_step().lower(setup.abstract_state(), setup.abstract_batch(), *setup.step_inputs())
    with compile_cache.standing_aside():
        module = hlo.read(lowered.compile().as_text())
    return [(operands[0].split("[")[0], operands) for _, _, operands, _ in hlo.dots(module)]


@needs_libtpu
def test_the_tpu_compiler_runs_int8_dots_where_asked_and_nowhere_else():
    """Compiled by XLA:TPU for v5e-8: with model.quant.targets=mlp every dot that contracts or yields the
    MLP's width (d_ff 96, no other dimension of this model) takes s8 operands and no other dot does; with the
    logits named too, the vocabulary's dots (384) are s8 as well; unquantised, none is; and fp8, which a v5e
    lacks, is refused in one sentence before anything compiles."""

    def touches(shapes, size):
        return any(re.search(rf"[\[,]{size}[\],]", s) for s in shapes)

    model = dict(d_ff=96)
    plain = _dots(micro_config(model=model), "v5e-8")
    assert plain and not [k for k, _ in plain if k == "s8"]
    mlp = _dots(micro_config(model={**model, "quant": dict(matmul="int8", targets=("mlp",))}), "v5e-8")
    assert {k == "s8" for k, shapes in mlp if touches(shapes, 96)} == {True}
    assert {k for k, shapes in mlp if not touches(shapes, 96)} <= {"bf16", "f32"}
    with_logits = _dots(micro_config(model={**model, "quant": dict(matmul="int8", targets=("mlp", "logits"))}),
                        "v5e-8")  # fmt: skip
    assert {k == "s8" for k, shapes in with_logits if touches(shapes, 96) or touches(shapes, 384)} == {True}
    with pytest.raises(ConfigError, match=r"^model.quant.matmul=fp8 on tpu-v5e, which has no fp8 matmul units; "
                                          r"use model.quant.matmul=int8\.$"):  # fmt: skip
        build(micro_config(model=dict(quant=dict(matmul="fp8"))), target_devices(parse_target("v5e-8")))


def test_quantisation_that_cannot_work_is_one_sentence_before_anything_compiles():
    def refused(model) -> str:
        with pytest.raises(ConfigError) as e:
            validate(micro_config(model=model))
        return str(e.value)

    assert refused(dict(quant=dict(matmul="int4"))) == "model.quant.matmul='int4' is not one of '', int8, fp8."
    assert refused(dict(quant=dict(matmul="int8", targets=("mlps",)))) == (
        "model.quant.targets='mlps' names mlps, which is not a matmul; the targets: attention,mlp,logits."
    )
    assert refused(dict(quant=dict(matmul="int8", targets=("experts",)))) == (
        "model.quant.targets='experts' matches no matmul of this model; the targets: attention,mlp,logits."
    )
    moe = dict(num_experts=4, experts_per_token=2)
    assert refused(dict(moe=moe, quant=dict(matmul="int8"))) == (
        "model.quant.matmul=int8 of the experts: model.moe.impl=dropless runs them as grouped-matmul kernels, "
        "which take no quantised operands; set model.moe.impl=capacity, or leave experts out of "
        "model.quant.targets."
    )
    validate(micro_config(model=dict(moe={**moe, "impl": "capacity"}, quant=dict(matmul="int8"))))
    validate(micro_config(model=dict(quant=dict(matmul="fp8"))))  # the dense model's default targets: fine


def test_a_quantised_run_skips_and_rolls_back_as_at_full_precision_and_exports_fp32(tmp_path, corpus_dir):
    """The spike defence sees what it sees at full precision: a non-finite loss makes non-finite int8
    gradients (a NaN's absmax scale is NaN, which the rescaled int32 sums keep), so each poisoned step is
    skipped with the parameters as they were, and a window longer than the budget rolls back to the same
    checkpoint, with the same batches passed over, as tests/test_stability.py's drill has it without
    quantisation."""
    from test_stability import config, records

    cfg = config(corpus_dir, poison_batches=(12, 13, 14, 15, 16, 17))
    cfg.model.quant.update(matmul="int8", targets=("attention", "mlp", "logits"))
    cfg.train.steps = 20
    result = train(cfg, str(tmp_path / "run"))
    logged = records(str(tmp_path / "run"))
    steps = {}
    for r in logged:  # the first time each step was taken: the rollback takes steps 11 on again
        if "loss" in r:
            steps.setdefault(r["step"], r)
    assert steps[13]["skipped"] == 1 and steps[13]["nonfinite"] == 1
    assert steps[13]["param_norm"] == steps[12]["param_norm"]
    (rollback,) = [r for r in logged if r.get("event") == "rollback"]
    assert rollback["reason"] == "4 bad steps in the last 10"
    assert rollback["to_step"] == 10 and rollback["lr_scale"] == 0.5 and rollback["data_batches_skipped"] == 7
    assert np.isfinite(result["loss"])

    # The export writes the master weights (the quantisation is training's own): fp32, all of them. Its file is
    # read with the hf extra's safetensors (CI installs it); without it the rollback above is what ran.
    load_file = pytest.importorskip("safetensors.numpy").load_file

    from trainer.interop.hf_files import WEIGHTS_FILE
    from trainer.interop.huggingface import export_checkpoint
    from trainer.training.resume import load_params

    export_checkpoint(cfg, str(tmp_path / "run"), None, str(tmp_path / "hf"))
    exported = load_file(str(tmp_path / "hf" / WEIGHTS_FILE))
    params = jax.device_get(load_params(cfg, str(tmp_path / "run"), None)[2])
    assert {t.dtype for t in exported.values()} == {np.dtype("float32")}
    np.testing.assert_allclose(sum(np.sum(np.square(t, dtype=np.float64)) for t in exported.values()),
                               sum(np.sum(np.square(p, dtype=np.float64)) for p in jax.tree.leaves(params)),
                               rtol=1e-12)  # fmt: skip
