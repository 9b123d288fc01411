"""Context parallelism (mesh.context): the same model, loss and gradients as on one device.

Packed documents cross the zig-zag chunks' borders; grouped-query heads (4 query heads on 2 key/value
heads); fp32, so "the same" is within float rounding.
"""

import jax
import numpy as np
import pytest
from conftest import micro_config

from trainer.evaluation.loss import evaluate_checkpoint
from trainer.model import context
from trainer.model.context import zigzag
from trainer.model.sampling import make_generate
from trainer.run.loop import train
from trainer.storage.checkpoint import Checkpointer
from trainer.training.setup import build
from trainer.training.state import abstract_params

BATCH, SEQ = 8, 32


def packed_batch(seed=0, rows=BATCH, seq=SEQ, starts=0.15) -> dict:
    """Documents of random lengths (about 1 / `starts` tokens), their positions restarting at 0, padding
    (id 0) at the end of each row."""
    rng = np.random.default_rng(seed)
    segments = np.cumsum(rng.random((rows, seq)) < starts, axis=1).astype(np.int32) + 1
    segments[:, -3:] = 0
    positions = np.zeros_like(segments)
    for t in range(1, seq):
        same = segments[:, t] == segments[:, t - 1]
        positions[:, t] = np.where(same, positions[:, t - 1] + 1, 0)
    tokens = rng.integers(0, 384, (rows, seq)).astype(np.int32)
    return dict(tokens=tokens, segment_ids=segments, positions=positions)


def loss_grads_logits(mode: str, mesh: dict, batch: dict, params=None, attention="xla", model=None):
    seq = batch["tokens"].shape[1]
    model = dict(context_attention=mode, attention=attention, max_seq_len=max(64, seq), **(model or {}))
    train = dict(global_batch_size=len(batch["tokens"]))
    setup = build(micro_config(mesh={"fsdp": 1, "data": -1, **mesh}, model=model, data=dict(seq_len=seq), train=train))
    params = setup.new_state().params if params is None else jax.device_put(params, setup.state_shardings.params)

    def loss(p, b):
        ce, count, _, _, _ = setup.model.apply(p, b["tokens"], b["positions"], b["segment_ids"], method="loss_sums")
        return ce / count

    batch = jax.device_put(batch, setup.batch_sharding)
    step = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    value, grads = step(params, batch)
    # Logits with the documents, and without segment ids (one causal sequence per row)
    logits = jax.jit(lambda p, b: [setup.model.apply(p, b["tokens"], b["positions"], ids)
                                   for ids in (b["segment_ids"], None)])(params, batch)  # fmt: skip
    return float(value), jax.device_get(grads), np.asarray(logits), step.as_text(), jax.device_get(params)


def test_the_zigzag_order_gives_each_device_an_early_and_a_late_chunk():
    assert zigzag(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    order = zigzag(64, 4).reshape(4, 16)  # per device: the sum of positions, hence causal work, is equal
    assert len(set(order.sum(1))) == 1 and sorted(zigzag(64, 4)) == list(range(64))


def test_context_2_and_4_with_fsdp_and_tensor_equal_one_device(monkeypatch):
    monkeypatch.setattr(context, "TILE", 4)  # each block scored 4 keys at a time: the tiling is exercised
    batch = packed_batch()
    loss, grads, logits, _, params = loss_grads_logits("ring", {}, batch)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    collectives = {}
    # Context 4 alone, 2 with fsdp and tensor (each mode), 4 with tensor in the run below.
    cases = [("ring", dict(context=4)), ("ring", dict(context=2, fsdp=2, tensor=2)),
             ("all_gather", dict(context=2, fsdp=2, tensor=2))]  # fmt: skip
    for mode, mesh in cases:
        other, other_grads, other_logits, hlo, _ = loss_grads_logits(mode, mesh, batch, params)
        assert other == pytest.approx(loss, rel=1e-6), (mode, mesh)
        np.testing.assert_allclose(other_logits, logits, atol=1e-5, err_msg=f"{mode} {mesh}")
        for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5 * scale, err_msg=f"{mode} {mesh}")
        collectives[mode, mesh.get("fsdp", 1)] = (hlo.count(" collective-permute"), hlo.count(" all-gather"))
    # The keys and values cross the axis as the mode says: round a ring (one permute per step forward, and
    # per step backward), or gathered at once. Both also permute the tokens into zig-zag order.
    ring, gathered = collectives["ring", 2], collectives["all_gather", 2]
    assert ring[0] > gathered[0] and gathered[1] > ring[1], collectives


def test_splash_over_the_gathered_keys_equals_one_device():
    """model.attention=splash with all_gather at context 2 x fsdp 2 x tensor 2: the Pallas kernel (interpret
    mode here) on each device's queries in zig-zag order, its mask reading their original positions;
    loss, gradients and logits as XLA's attention on one device."""
    batch = packed_batch(rows=8, seq=256, starts=0.02)  # one 128-token block per device and row
    loss, grads, logits, _, params = loss_grads_logits("ring", {}, batch)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
    mesh = dict(context=2, fsdp=2, tensor=2)
    other, other_grads, other_logits, hlo, _ = loss_grads_logits("all_gather", mesh, batch, params, "splash")
    assert other == pytest.approx(loss, rel=1e-6)
    np.testing.assert_allclose(other_logits, logits, atol=1e-5)
    for a, b in zip(jax.tree.leaves(other_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * scale)


@pytest.mark.slow  # the scripts' whole workflow on a context mesh, 23 s (2026-12-06); the equivalence stays fast
def test_a_run_split_over_context_trains_resumes_onto_another_context_evaluates_and_decodes(tmp_path):
    """Two steps at context 2 (with fsdp and tensor), two more at context 4: the losses and weights of
    a run on one device's layout (context 1), within fp32 rounding; its checkpoint evaluates the same on
    context 2 and 1 and decodes the same greedy text."""

    def config(steps, **mesh):
        cfg = micro_config(train=dict(steps=steps, log_every=1, eval_every=0), mesh={"fsdp": 1, "data": -1, **mesh})
        cfg.optim.update(schedule="constant", warmup_steps=1)
        cfg.checkpoint.update(every_steps=2, keep=5)
        return cfg

    reference = train(config(4), str(tmp_path / "one"))
    train(config(2, context=2, fsdp=2, tensor=2), str(tmp_path / "split"))
    resumed = train(config(4, context=4, tensor=2), str(tmp_path / "split"))
    assert resumed["step"] == 4
    assert resumed["loss"] == pytest.approx(reference["loss"], rel=1e-5)

    scores = [evaluate_checkpoint(config(4, **mesh), str(tmp_path / "split"), max_batches=2)["loss"]
              for mesh in (dict(context=2), {})]  # fmt: skip
    assert scores[0] == pytest.approx(scores[1], rel=1e-6)

    prompt = np.random.default_rng(1).integers(3, 384, (2, 5)).astype(np.int32)
    texts = []
    for mesh in (dict(context=4, tensor=2), {}):
        setup = build(config(4, **mesh))
        ckpt = Checkpointer(str(tmp_path / "split" / "checkpoints"), read_only=True)
        params = ckpt.restore_params(4, abstract_params(setup.model, setup.shard))
        ckpt.close()
        texts.append(np.asarray(make_generate(setup.spec, setup.shard, max_new_tokens=6)(params, prompt, 0)))
    np.testing.assert_array_equal(texts[0], texts[1])
