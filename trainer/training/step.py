"""The jitted train and eval steps.

One train step is one optimiser update on the batch it is given: `k`
microbatches (train.grad_accum_steps, or fewer while a batch-size ramp
grows), split inside the jitted step and accumulated in fp32 by a scan.
Token losses are summed and divided once by the step's token count, so k
microbatches give the gradient of the whole batch, not an average of
per-microbatch means. What is differentiated is that sum times the loss
scale over the batch's token positions (a constant of the trace, near the
count), so the gradients' size, and the fp16 scale that fits them, do not
grow with the batch (trainer/training/precision.py).

The step then judges itself (trainer/training/stability.py): non-finite or spiking
gradients leave parameters and optimiser state untouched. The learning rate is
set here, from the schedule at the current sequence count, times the rollback
scale and any drill multiplier (computed here from the data clock), so a step's
logged rate is the one it used.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from parallelism import microbatches
from parallelism.rules import LogicalSharding
from trainer.config import stream_rows
from trainer.model import adapters
from trainer.model.decoder import ModelDef
from trainer.model.moe import empty_statistics
from trainer.objectives import distill, dpo, grpo
from trainer.optim import averaging
from trainer.optim.optimizer import applied_learning_rate, with_hyperparams
from trainer.optim.schedules import make_schedule
from trainer.training import clock, stability
from trainer.training.precision import LossScaling
from trainer.training.state import TrainState, param_shardings, trained

BATCH_KEYS = ("tokens", "segment_ids", "positions")
BATCH_NAMES = ("batch", "seq")
OFFLINE_TEACHER = ("teacher_ids", "teacher_logits")  # trainer/data/teacher_logits.py: (batch, seq, top_k) each


def batch_keys(cfg, training: bool = True) -> tuple[str, ...]:
    """What a batch holds: post-training's also say which tokens are trained on (trainer/data/chat.py);
    reinforcement learning's also its completions' log-probabilities and advantages (trainer/objectives/grpo.py);
    a training batch of offline distillation also its teacher's logits (held-out batches have none)."""
    keys = BATCH_KEYS + ("loss_mask",) * (cfg.data.format != "text")
    if cfg.data.format == "prompts":
        keys += ("old_logps", "advantages", "fresh") + ("ref_logps",) * (cfg.rl.beta > 0)
    if training and cfg.distill.teacher and cfg.distill.mode == "offline":
        keys += OFFLINE_TEACHER
    if training and cfg.distill.teacher and cfg.distill.on_policy:
        keys += ("sampled",)  # trainer/training/student_samples.py
    return keys


def _sums(model: ModelDef, params, batch, z_loss: float, moe=None, mtp_weight: float = 0.0, key=None):
    """(objective sum, (cross-entropy sum, target token count, largest |logit|, MoE statistics, {})) over the
    batch (the empty dict: DPO's metric sums, trainer/objectives/dpo.py).

    The MoE layers' auxiliary losses (means over the batch's positions, summed over layers) enter the sum
    times the batch's positions, so that the step's division by them leaves `aux_loss` x balance and
    `z_loss` x the router's log(Z)^2 beside the mean cross-entropy. Multi-token prediction's modules'
    cross-entropy sums enter times `mtp_weight` / depth (trainer/model/mtp.py). `key`: the adapters' dropout
    key (model.lora.dropout), or None."""
    ce, count, log_z_sq, largest, stats = model.apply(
        params, batch["tokens"], batch["positions"], batch["segment_ids"], batch.get("loss_mask"), key,
        method="loss_sums",
    )  # fmt: skip
    objective = ce
    if "mtp" in stats and mtp_weight:
        objective = objective + mtp_weight / stats["mtp"]["ce"].shape[0] * jnp.sum(stats["mtp"]["ce"])
    return _regularised(objective, log_z_sq, stats, batch, z_loss, moe), (ce, count, largest, stats, {})


def _regularised(objective, log_z_sq, stats: dict, batch: dict, z_loss: float, moe):
    """An objective's sum with the z-loss and the MoE layers' auxiliary losses added (see _sums)."""
    objective = objective + z_loss * log_z_sq
    if stats.get("load") is not None and moe is not None:
        aux = moe.aux_loss * jnp.sum(stats["balance_loss"]) + moe.z_loss * jnp.sum(stats["router_z"])
        objective = objective + batch["tokens"].size * aux
    return objective


def split_microbatches(batch: dict, k: int, shard: LogicalSharding) -> dict:
    """(k*m, T) -> (k, m, T), split as parallelism/microbatches.py says, each still over the data axes."""
    return jax.tree.map(lambda x: shard.constrain(microbatches.split(x, k), (None, *BATCH_NAMES)), batch)


def _over_microbatches(fn, batch: dict, k: int, shard: LogicalSharding, init, combine):
    """`fn(microbatch, its index)` of each of the batch's k microbatches, folded with `combine` (in a scan
    when k > 1)."""
    if k == 1:
        return fn(batch, 0)

    def body(carry, indexed):
        return combine(carry, fn(indexed[1], indexed[0])), None

    return jax.lax.scan(body, init, (jnp.arange(k), split_microbatches(batch, k, shard)))[0]


def _add(total, new):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), total, new)


def _layer_norms(grads: dict) -> dict[str, jax.Array]:
    """Gradient norm of each stacked weight, per layer: (layers in its stack,) each."""
    norms = {}
    for stack in ("dense_layers", "dense_between", "layers", "local_layers", "linear_layers"):
        for path, g in jax.tree_util.tree_leaves_with_path(grads.get(stack, {})):
            name = f"grad_norm/{stack}." + ".".join(str(k.key) for k in path)
            norms[name] = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim))))
    return norms


def _moe_metrics(stats: dict) -> dict[str, jax.Array]:
    """The MoE layers' figures for the log: auxiliary losses and dropped share (means over layers), and each
    layer's load: the most loaded expert's share over the mean share, and every expert's share."""
    if not stats:
        return {}
    load = stats["load"]  # (moe layers, experts), each row summing to 1
    metrics = {f"moe/{name}": jnp.mean(stats[name]) for name in ("balance_loss", "router_z", "dropped")}
    for i in range(load.shape[0]):
        metrics[f"moe/load_max_mean/{i}"] = jnp.max(load[i]) * load.shape[1]
        metrics.update({f"moe/load/{i}/{e}": load[i, e] for e in range(load.shape[1])})
    return metrics


def _balance_router(params: dict, load: jax.Array, rate: float) -> dict:
    """DeepSeek-V3's loss-free balancing: each expert's router bias steps `rate` up if its share of the
    step's assignments was below the mean, down if above."""
    moe = params["layers"]["moe"]
    bias = moe["router_bias"] + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    return {**params, "layers": {**params["layers"], "moe": {**moe, "router_bias": bias}}}


def _loss_and_norm(measured: tuple) -> tuple:
    return measured[1], optax.global_norm(measured[0])


def make_train_step(
    model: ModelDef,
    tx: optax.GradientTransformation,
    shard: LogicalSharding,
    cfg,
    microbatches: int,
    teacher: ModelDef | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
    """(state, batch, *inputs) -> (state, metrics). The inputs: under model.lora the frozen base, which the
    state's adapters join (DPO's reference is then the base with the adapters switched off); under DPO
    (data.format=preference) without adapters its reference parameters; then, distilling online, the
    parameters `teacher` applies (trainer/objectives/distill.py: its loss is then the objective's mean, its
    cross-entropy and divergence logged apart)."""
    k = microbatches
    scaling = LossScaling.from_config(cfg)
    schedule = make_schedule(cfg.optim, cfg.train.steps)
    batch_size = stream_rows(cfg)  # the schedule's unit: the global batch, or the run's first (batch_ramp.py)
    z_loss, weight_decay, moe, mtp_weight = (
        cfg.optim.z_loss,
        cfg.optim.weight_decay,
        cfg.model.moe,
        cfg.model.mtp.weight,
    )
    no_stats = empty_statistics(model.arch)
    preference = cfg.data.format == "preference"
    rl = cfg.data.format == "prompts"
    no_extra = {f"dpo/{m}": 0.0 for m in dpo.METRICS} if preference else {}
    no_extra = {f"rl/{m}": 0.0 for m in grpo.METRICS} if rl else no_extra
    distilling = bool(cfg.distill.teacher)
    no_extra = {f"distill/{m}": 0.0 for m in distill.METRICS} if distilling else no_extra
    adapted = bool(model.arch.lora.rank)
    dropout = adapted and cfg.model.lora.dropout > 0

    def ema_decay(tokens: int) -> dict:  # a constant of the trace: the batch's shape says its tokens
        if not averaging.enabled(cfg.optim):
            return {}
        return {"ema_decay": jnp.float32(averaging.step_decay(cfg.optim, tokens))}

    def scaled(params, batch, factor, inputs, key):
        teacher_params = None
        if teacher is not None:
            inputs, teacher_params = inputs[:-1], inputs[-1]
        if adapted:  # the gradient is of the adapters alone: the base is an input, not a variable
            base = inputs[0]
            params, reference = adapters.join(params, base), adapters.join(adapters.switched_off(params), base)
        else:
            reference = inputs[0] if inputs else None
        if preference:
            objective, aux = dpo.sums(model, params, reference, batch, cfg.dpo, key)
            aux = (*aux[:4], {f"dpo/{m}": v for m, v in aux[4].items()})
        elif rl:  # the reference's log-probabilities came with the batch
            objective, aux = grpo.sums(model, params, batch, cfg.rl, key)
            aux = (*aux[:4], {f"rl/{m}": v for m, v in aux[4].items()})
        elif distilling:
            objective, (count, log_z_sq, largest, stats, sums) = distill.sums(
                model, params, teacher, teacher_params, batch, cfg.distill, cfg.model.loss_chunk, key)  # fmt: skip
            aux = (objective, count, largest, stats, {f"distill/{m}": v for m, v in sums.items()})
            objective = _regularised(objective, log_z_sq, stats, batch, z_loss, moe)
        else:
            objective, aux = _sums(model, params, batch, z_loss, moe, mtp_weight, key)
        return objective * factor, aux

    grad_fn = jax.value_and_grad(scaled, has_aux=True)
    grad_shardings = trained(param_shardings(model, shard), model) if shard.mesh is not None else None

    def train_step(state: TrainState, batch: dict, *inputs):
        stats, counts = state.stability, state.clock
        rows, positions = batch["tokens"].shape[0], batch["tokens"].size
        loss_multiplier, lr_multiplier = stability.drill_multipliers(cfg, counts["data_read"], rows)
        scale = state.loss_scale["scale"]
        # The token count comes out of the forward pass, not before it: counting up front adds a
        # collective that depends on nothing, which XLA:CPU may run beside the first weight
        # all-gather, and simulated devices then deadlock (seen resuming past a damaged checkpoint).
        # A poisoned drill batch makes the factor, and so the loss and gradients, non-finite.
        factor = scale * loss_multiplier / positions

        # The adapters' dropout: masks from the run's seed, the step and the microbatch alone, so a resumed
        # or rolled-back run draws the same ones.
        step_key = jax.random.fold_in(jax.random.key(cfg.train.seed), state.step) if dropout else None

        def micro_step(micro, i):
            key = None if step_key is None else jax.random.fold_in(step_key, i)
            (_, (ce, count, largest, moe_stats, extra)), grads = grad_fn(state.params, micro, factor, inputs, key)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads), ce, count, largest, moe_stats, extra

        def combine(total, new):
            return (_add(total[0], new[0]), total[1] + new[1], total[2] + new[2], jnp.maximum(total[3], new[3]),
                    _add(total[4], new[4]), _add(total[5], new[5]))  # fmt: skip

        def measured():
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            if grad_shardings is not None:
                zeros = jax.lax.with_sharding_constraint(zeros, grad_shardings)
            grads, ce, count, max_logit, moe_stats, extra = _over_microbatches(
                micro_step, batch, k, shard, (zeros, 0.0, 0.0, 0.0, no_stats, no_extra), combine
            )
            count = jnp.maximum(count, 1.0)
            # Unscale in fp32, and turn the sum over positions into the mean over target tokens.
            grads = jax.tree.map(lambda g: g * (positions / (count * scale)), grads)
            return grads, ce / count * loss_multiplier, count, max_logit, moe_stats, extra

        grads, loss, count, max_logit, moe_stats, extra = measured()
        grads = stability.flipped(cfg, grads, counts["data_read"], rows)  # the debug.flip_batches drill
        mtp = moe_stats.pop("mtp", None)  # sums, not means
        moe_stats = jax.tree.map(lambda s: s / k, moe_stats)  # each microbatch's are means over its positions
        grad_norm = optax.global_norm(grads)
        ok, finite, spike = stability.judge(cfg, stats, loss, grad_norm)
        bad = ~ok & ~scaling.overflowed(loss, grad_norm, scale)
        if cfg.stability.rerun_bad_steps:  # a bad step computed again (without the drill): the same result?
            stats = stability.rerun(stats, bad, loss, grad_norm, lambda: _loss_and_norm(measured()))

        lr = schedule(clock.in_batches(counts["sequences"], batch_size)) * stats["lr_scale"] * lr_multiplier
        opt_state = with_hyperparams(state.opt_state, learning_rate=lr, weight_decay=jnp.float32(weight_decay),
                                     **ema_decay(positions))  # fmt: skip
        updates, new_opt = tx.update(grads, opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        if moe_stats and moe.router_bias and not adapted:  # under model.lora the router's bias is frozen too
            new_params = _balance_router(new_params, moe_stats["load"], moe.router_bias)

        def keep(new, old):  # skipped steps leave the state as it was
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

        params, opt_state = keep(new_params, state.params), keep(new_opt, state.opt_state)
        loss_scale = scaling.update(state.loss_scale, jnp.isfinite(grad_norm))
        stats = stability.update_statistics(cfg, stats, state.step, ok, bad, loss, grad_norm)
        counts = {**counts, "sequences": clock.add(counts["sequences"], jnp.where(ok, rows, 0), batch_size),
                  "data_read": clock.add(counts["data_read"], rows, batch_size)}  # fmt: skip
        param_norm = optax.global_norm(params)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,  # before clipping
            "param_norm": param_norm,
            "update_ratio": jnp.where(ok, optax.global_norm(updates) / param_norm, 0.0),
            "lr": applied_learning_rate(new_opt),
            "max_logit": max_logit,
            "skipped": (~ok).astype(jnp.int32),
            "overflow": (~ok & ~bad).astype(jnp.int32),
            "nonfinite": (~finite).astype(jnp.int32),
            "spike": spike.astype(jnp.int32),
            "skipped_total": stats["skipped"],
            "rerun_transient": stats["rerun_transient"],  # totals, as skipped_total (stability.rerun_bad_steps)
            "rerun_persistent": stats["rerun_persistent"],
            "bad_in_window": jnp.sum(stats["recent_bad"]),
            "diverged_run": stats["diverged_run"],
            # The sequences trained on, in two words (trainer/training/clock.py): the loop makes them one number.
            "sequences_batches": counts["sequences"]["batches"],
            "sequences_rows": counts["sequences"]["rows"],
            "loss_scale": loss_scale["scale"],
            "target_tokens": count,  # the tokens trained on (post-training: those loss_mask keeps); DPO: pairs
            **{name: total / count for name, total in extra.items()},  # DPO's figures, means over the pairs
        }
        metrics.update(_moe_metrics(moe_stats))
        if mtp is not None:  # each module's own mean cross-entropy: module k predicts k + 1 tokens past the next
            metrics.update({f"mtp_loss/{i + 1}": mtp["ce"][i] / jnp.maximum(mtp["count"][i], 1.0)
                            for i in range(mtp["ce"].shape[0])})  # fmt: skip
        if cfg.train.layer_grad_norms:
            metrics.update(_layer_norms(grads))
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, clock=counts,
                                  loss_scale=loss_scale, stability=stats)  # fmt: skip
        return new_state, metrics

    return train_step


def make_eval_step(model: ModelDef, shard: LogicalSharding, microbatches: int) -> Callable[[dict, dict], tuple]:
    """(params, batch) -> (sum of token losses, token count), over the batch's microbatches (the tokens
    trained on, where the batch says which)."""

    def eval_step(params, batch):
        def micro_sums(micro, _):
            return _sums(model, params, micro, 0.0)[1][:2]  # the cross-entropy alone

        return _over_microbatches(micro_sums, batch, microbatches, shard, (0.0, 0.0), _add)

    return eval_step


def jit_train_step(step_fn, state_shardings: TrainState, shard: LogicalSharding, keys=BATCH_KEYS, inputs=()):
    """Explicit in/out shardings; the old state is donated so its buffers are reused. `inputs`: the shardings
    of the step's inputs after the batch (Setup.step_inputs: a frozen base, DPO's reference, a teacher; never
    donated)."""
    batch = {k: shard.named(BATCH_NAMES) for k in keys}
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch, *inputs),
        out_shardings=(state_shardings, shard.replicated()),
        donate_argnums=0,
    )


def jit_eval_step(eval_fn, weight_shardings: dict, shard: LogicalSharding, keys=BATCH_KEYS):
    """`weight_shardings`: of every parameter the model applies (under model.lora, base and adapters)."""
    batch = {k: shard.named(BATCH_NAMES) for k in keys}
    return jax.jit(eval_fn, in_shardings=(weight_shardings, batch), out_shardings=shard.replicated())


def abstract_batch(global_batch: int, seq_len: int, sharding, keys=BATCH_KEYS, top_k: int = 0) -> dict:
    """The batch's shapes and placement, for compiling ahead of the first real batch (`top_k`: offline
    distillation's logits a position)."""
    dtype = lambda k: jnp.float32 if k in grpo.FIELDS or k == "teacher_logits" else jnp.int32  # noqa: E731
    shape = lambda k: (global_batch, seq_len, top_k) if k in OFFLINE_TEACHER else (global_batch, seq_len)  # noqa: E731
    return {k: jax.ShapeDtypeStruct(shape(k), dtype(k), sharding=sharding) for k in keys}


def memory_per_device(compiled, platform: str, heap: int | None = None) -> dict[str, int]:
    """XLA's bytes per device for a compiled step; `total` is what a device must hold for it.

    On a TPU that is XLA:TPU's HBM heap when it is given (`heap`, from
    compile_with_heap): the step's arguments plus the one block of temporaries
    the runtime allocates. Without it, XLA's peak: XLA:TPU and XLA:GPU simulate
    the step's buffers and report their peak, arguments included (on TPU also
    the few in on-chip memory, up to 0.11 GiB), which fragmentation leaves 0.1-5%
    below the heap (eight compiles of tiny, small and llm_1b on v5e and v5p).
    Their `temp_size_in_bytes` is neither: on TPU it counts up to 3 GiB more
    than the heap's temporaries (llm_1b at fsdp=4 on v5e-4: 13.6 against 10.6),
    and XLA:TPU compiles steps whose arguments + temporaries exceed the chip.
    XLA:CPU computes no peak (it reports the arguments): there the total is
    arguments + outputs not aliased to donated inputs + temporaries. `platform`
    is that of the devices compiled for.
    """
    mem = compiled.memory_analysis()
    breakdown = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
    }
    if platform == "cpu":
        breakdown["total"] = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
        breakdown["total"] += mem.temp_size_in_bytes
        return breakdown
    breakdown["peak"] = mem.peak_memory_in_bytes
    if heap is not None:
        breakdown["heap"] = heap
    breakdown["total"] = breakdown.get("heap", breakdown["peak"])
    return breakdown


# Each memory space's total in XLA:TPU's memory-usage report: "default" is HBM, "vmem" the on-chip memory.
_MEMORY_SPACE = re.compile(r"Memory Space: (\w+) \(color=\d+\)\nTotal bytes: (\d+)")


class OutOfHbm(Exception):
    """XLA:TPU refused to compile the step: its HBM heap exceeds what the chip offers a program.

    Its text is XLA's line ("Ran out of memory on HBM, ..."); `heap` the heap it
    had assigned (its "HLO temporaries", the state included), or None where no
    report was written.
    """

    def __init__(self, message: str, heap: int | None):
        super().__init__(message)
        self.heap = heap


def compile_with_heap(lowered, platform: str, options: dict | None = None):
    """Compile, and on a TPU read the HBM heap XLA:TPU assigned: (compiled, bytes per device).

    The heap is only written out, in the buffer-assignment report XLA dumps
    (`xla_dump_to`), so a TPU compile dumps into a temporary folder (a few MB)
    and reads its size from there; where the report is missing, the total
    falls back to XLA's peak (memory_per_device). The report also gives what
    XLA:TPU placed in on-chip memory beside the heap (`vmem`: tens of MiB; for
    a small step, a good part of it). XLA:TPU writes the report before it
    refuses a step too large for the chip, so a refusal raises OutOfHbm with
    the heap it would have needed. `options`: more compile options (libtpu's
    checker, trainer/training/sdc.py).
    """
    if platform != "tpu":
        compiled = lowered.compile(compiler_options=options)
        return compiled, memory_per_device(compiled, platform)
    with tempfile.TemporaryDirectory() as folder:
        try:
            compiled = lowered.compile(compiler_options={"xla_dump_to": folder, **(options or {})})
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            said = re.search(r"Ran out of memory[^\n]*", str(e))
            raise OutOfHbm(said.group(0) if said else str(e).splitlines()[0], _spaces(folder).get("default")) from e
        spaces = _spaces(folder)
    breakdown = memory_per_device(compiled, platform, spaces.get("default"))
    if "vmem" in spaces:
        breakdown["vmem"] = spaces["vmem"]
    return compiled, breakdown


def _spaces(folder: str) -> dict[str, int]:
    for report in glob.glob(os.path.join(folder, "*memory-usage-report.txt")):
        found = dumped_spaces(report)
        if "default" in found:
            return found
    return {}


def dumped_spaces(report: str) -> dict[str, int]:
    """Bytes per memory space (`default` is the HBM heap, `vmem` on-chip) in a memory-usage report XLA:TPU
    dumped, ours or another program's (benchmarks/vs_maxtext.py)."""
    with open(report) as f:
        return {name: int(total) for name, total in _MEMORY_SPACE.findall(f.read())}
