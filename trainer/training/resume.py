"""Starting from saved weights: resuming a run, resetting its optimiser, beginning from another run's,
or reading a run's parameters alone (evaluation, generation, export).

What may change across a resume is derived, not listed. A run's saved config
(config.json) is compared with the new one three ways, each by what it feeds:
the model's architecture (trainer/model/decoder.py), the data stream
(trainer/data/streams.py) and the optimiser state's structure, shapes and
dtypes. For every key that differs, the key alone is applied to the saved
config; if that changes one of the three, the resume is refused, naming the
key and both values, before anything on disk is touched. Any other change
(mesh, remat, kernel, precision, learning rate, stability, logging,
accumulation) resumes.

A checkpoint is then read into the target shapes and shardings of whatever
mesh the config now asks for. `checkpoint.reset_optimizer` keeps the weights,
step, schedule and data position and starts the optimiser state afresh; it is a
label, and each checkpoint records the label of its run's last reset, so each
new label resets once and a relaunch of the same command resumes the new state;
`checkpoint.init_from` starts a new run from another run's weights.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainer.config import stream_rows
from trainer.config.errors import ConfigError, StorageError
from trainer.config.forms import flatten, from_dict, with_changes
from trainer.data import run_tokenizer
from trainer.data.streams import Stream
from trainer.model import adapters, quantised
from trainer.model.spec import Architecture
from trainer.optim import averaging
from trainer.optim.optimizer import make_optimizer
from trainer.storage import compile_cache, faults
from trainer.storage import workdir as wd
from trainer.storage.checkpoint import OPT_STATE, Checkpointer, Unreadable, arrays
from trainer.training import clock, stability
from trainer.training.precision import LossScaling
from trainer.training.setup import Setup, build
from trainer.training.state import TrainState, abstract_params, frozen, state_from_params, trained


def saved_config(workdir: str):
    saved = wd.saved_config(workdir)
    return None if saved is None else from_dict(saved)


def changed_keys(saved, cfg, view: Callable) -> list[str]:
    """'key=old there, new here' for each key whose change alone changes `view` of the saved config; none where the
    views agree (keys that change together and cancel: a new global batch beside the run's data.stream_rows)."""
    before, now, base = flatten(saved), flatten(cfg), view(saved)
    if view(cfg) == base:
        return []
    return [
        f"{key}={before[key]!r} there, {now[key]!r} here"
        for key in sorted(now)
        if before.get(key) != now[key] and view(with_changes(saved, {key: now[key]})) != base
    ]


def check_architecture(workdir: str, cfg, saved=None) -> None:
    """Refuse a config whose model (or kind of tokenizer) would read the saved weights differently; the
    tokenizer's file is checked against the run's copy of it (trainer/data/run_tokenizer.py)."""
    saved = saved if saved is not None else saved_config(workdir)
    if saved is None:
        return
    differ = changed_keys(saved, cfg, lambda c: (Architecture.from_config(c), c.data.tokenizer))
    if differ:
        raise ConfigError(
            f"{workdir} belongs to another run ({'; '.join(differ)}); use its values or another --workdir."
        )


def check_resume(workdir: str, cfg, setup, saved=None) -> None:
    """Everything a resume may refuse, judged from the saved config (config.json's, or `saved`: the one a
    local checkpoint recorded), before anything is read or written."""
    saved = saved if saved is not None else saved_config(workdir)
    if saved is None:
        return
    check_architecture(workdir, cfg, saved)
    check_start(workdir, cfg, saved)
    if saved.distill.teacher and cfg.distill.teacher and saved.distill.mode != cfg.distill.mode:
        raise ConfigError(
            f"{workdir} was distilled {saved.distill.mode} (its config.json's distill.mode); resume it with "
            f"--config.distill.mode={saved.distill.mode}, or give this {cfg.distill.mode} run another --workdir."
        )
    differ = changed_keys(saved, cfg, lambda c: Stream.from_config(c).identity())
    if differ:
        raise ConfigError(
            f"{workdir} was trained on another data stream ({'; '.join(differ)}); use its values, or start a "
            f"new run from its weights with --config.checkpoint.init_from={workdir} and another --workdir."
        )
    if not cfg.checkpoint.reset_optimizer:
        differ = changed_keys(saved, cfg, lambda c: _optimizer_shapes(c, setup))
        if differ:
            raise ConfigError(
                f"{workdir} holds another optimiser's state ({'; '.join(differ)}); to go on with this one from "
                "the saved weights, step, schedule and data, add --config.checkpoint.reset_optimizer=true."
            )


def check_start(workdir: str, cfg, saved) -> None:
    """Refuse what only a run's start reads, changed on a resume, where it would be dropped without a word: the
    weights it started from (checkpoint.init_from; the base of adapters and the reference of DPO and GRPO are
    pinned to DIR@STEP at the start) and their initialisation (model.init_std)."""
    then, now = saved.checkpoint.init_from, cfg.checkpoint.init_from
    if now and not _same_start(then, now):
        start = f"checkpoint.init_from={then!r}" if then else "weights of its own initialisation"
        raise ConfigError(
            f"{workdir} started from {start} (its config.json); a run keeps the weights it started from, so "
            f"checkpoint.init_from={now!r} would not be read: resume with --config {workdir}/config.json, or start "
            "a new run from it with another --workdir."
        )
    if saved.model.init_std != cfg.model.init_std:
        raise ConfigError(
            f"{workdir} was initialised with model.init_std={saved.model.init_std!r} (its config.json); "
            f"{cfg.model.init_std!r} here would not be read: resume with --config {workdir}/config.json, or start "
            "a new run with another --workdir."
        )


def _same_start(then: str, now: str) -> bool:
    """Whether init_from `now` names the start `then` records: the same directory, and the same step where both
    give one (a start recorded as DIR@STEP was DIR's newest then)."""
    if not then:
        return False
    (a, i), (b, j) = parse_init_from(then), parse_init_from(now)
    place = lambda p: p.rstrip("/") if wd.is_remote(p) else os.path.abspath(p)  # noqa: E731
    return place(a) == place(b) and (i is None or j is None or i == j)


def _optimizer_shapes(cfg, setup):
    """The optimiser state's structure, shapes and dtypes under `cfg`, for the setup's model."""
    tx = make_optimizer(cfg, trained(setup.model.logical_names, setup.model))
    abstract = jax.eval_shape(tx.init, trained(setup.model.abstract_params, setup.model))
    return jax.tree.structure(abstract), [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]


def reset_label(label: str) -> int:
    """checkpoint.reset_optimizer as the number a checkpoint records (0: none)."""
    return zlib.crc32(label.encode()) & 0x7FFFFFFF or 1 if label else 0


def restore_state(
    ckpt: Checkpointer, step: int, setup, data_iterator, saved=None, asked: int | None = None
) -> tuple[TrainState, bool, int]:
    """(the state saved at `step`, placed for this setup's mesh; whether the optimiser state was reset; the
    label of the run's last reset, to record in later checkpoints).

    `asked`: the reset label asked for (reset_label(); default: the config's). The state is reset when
    a label is asked that differs from the checkpoint's, or when it is asked and the state does not fit.

    Raises ConfigError for a checkpoint that does not fit the config (nothing is
    changed on disk); any other exception means its files cannot be read.
    """
    cfg, abstract = setup.cfg, setup.abstract_state()
    metadata = ckpt.metadata(step)
    ckpt.check_params(step, abstract.params)
    replicated = setup.shard.replicated()
    meta = ckpt.restore_meta(step, replicated)
    batch_size = stream_rows(cfg)
    if "format" not in meta and data_iterator is not None:
        rows = ckpt.data_rows(step)
        if rows is not None and len(rows) < batch_size:
            raise ConfigError(
                f"the checkpoint at step {step} in {ckpt.directory} keeps its data position by microbatch row "
                f"({len(rows)} rows of a {batch_size}-sequence batch, written with gradient accumulation by an "
                "older trainer), which cannot be converted; resume it with the trainer that wrote it, or start a "
                "new run from its weights with --config.checkpoint.init_from."
            )
    fits = arrays(metadata[OPT_STATE]) == arrays(abstract.opt_state)
    asked = reset_label(cfg.checkpoint.reset_optimizer) if asked is None else asked
    done = int(meta.get("reset_optimizer", 0))
    if int(meta.get("format", 0)) < 4 and done:  # a flag then: whether its run had asked, always with `true`
        done = reset_label("true")
    reset = bool(asked) and (asked != done or not fits)
    if not fits and not reset:
        raise ConfigError(
            f"the optimiser state in the checkpoint at step {step} in {ckpt.directory} does not fit this config's "
            "optimiser; use the optim.* and precision.moments_dtype it was written with, or add "
            "--config.checkpoint.reset_optimizer=true."
        )
    params, opt_state = ckpt.restore(step, abstract.params, None if reset else abstract.opt_state, data_iterator)
    if reset:
        opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings.opt_state)(params)
    counters = _counters(meta, cfg, saved)
    on_mesh = jax.device_put({"step": meta["step"], "rng": meta["rng"], **counters}, replicated)
    return TrainState(params=params, opt_state=opt_state, **on_mesh), reset, asked if reset else done


def from_local(local, newest: int, abstract, workdir: str, cfg, setup, new_data: Callable, saved, say):
    """(step, (state, False, reset label, data)) from the local tier (trainer/storage/local_tier.py), if it holds
    a step of this run newer than the persistent tier's `newest` that every process can restore; else None."""
    data = new_data()
    try:
        found = local.restore(newest, abstract, data, reset_label(cfg.checkpoint.reset_optimizer), say,
                              lambda config: check_resume(workdir, cfg, setup, from_dict(config)))  # fmt: skip
    except BaseException:
        data.close()
        raise
    if found is None:
        data.close()
        return None
    step, fields, label = found
    return step, (state_from_local(fields, setup, saved), False, label, data)


def state_from_local(fields: dict, setup, saved=None) -> TrainState:
    """A local checkpoint's fields (trainer/storage/local_tier.py) as the state, its counters read as a
    persistent checkpoint's are (converted to this config's batch, loss scaling and stability settings)."""
    meta = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                        {k: fields[k] for k in ("step", "rng", "clock", "loss_scale", "stability")})  # fmt: skip
    counters = _counters(meta, setup.cfg, saved)
    on_mesh = jax.device_put({"step": meta["step"], "rng": meta["rng"], **counters}, setup.shard.replicated())
    return TrainState(params=fields["params"], opt_state=fields["opt_state"], **on_mesh)


def _counters(meta: dict, cfg, saved) -> dict:
    """The clock, loss scale and stability entries of a restored meta item, whichever layout wrote it.

    Format 4 counts in two words (trainer/training/clock.py) and the batch they
    count in, converted here to this config's batch. Format 3 kept the three
    apart, with int32 counts. Format 2 (commit 40ed449) kept all in
    `stability`; checkpoints with no format (2549b1c and before) did too, and
    counted microbatches, which are global batches here (a checkpoint written
    with accumulation is refused before this).
    """
    old, batch = meta["stability"], stream_rows(cfg)
    if "clock" in meta:
        counts, scale = meta["clock"], meta["loss_scale"]
        if "batch" in counts:
            counts = {k: clock.value(counts[k], int(counts["batch"])) for k in ("sequences", "data_read")}
    else:
        per = 1 if "format" in meta else batch
        trained = old["sequences"] if "sequences" in old else old["microbatches"]
        counts = {"sequences": int(trained) * per, "data_read": int(old["data_read"]) * per}
        scale = {"scale": old["loss_scale"], "good_steps": old["good_steps"]}
    scaling = LossScaling.from_config(cfg)
    saved_dynamic = LossScaling.from_config(saved).dynamic if saved is not None else scaling.dynamic
    return {
        "clock": {**{k: clock.of(int(v), batch) for k, v in counts.items()}, "batch": np.int32(batch)},
        "loss_scale": scaling.resumed(
            {"scale": np.float32(scale["scale"]), "good_steps": np.int32(scale["good_steps"])}, saved_dynamic
        ),
        "stability": stability.adopt(old, cfg, int(meta["step"])),
    }


def parse_init_from(text: str) -> tuple[str, int | None]:
    """'DIR' or 'DIR@STEP' -> (DIR, STEP or None)."""
    return wd.at_step(text, "checkpoint.init_from")


def load_init_params(cfg, setup) -> tuple[dict, str, int]:
    """The parameters `checkpoint.init_from` names, in this setup's shardings: (params, directory, step)."""
    path, step = parse_init_from(cfg.checkpoint.init_from)
    if not wd.path(path).exists():
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from!r}: {path} does not exist.")
    source = saved_config(path)
    if source is not None:
        run_tokenizer.check_same_tokens(cfg, path, source, f"checkpoint.init_from={cfg.checkpoint.init_from!r}",
                                        "this run", "its embedding rows would mean other tokens: give weights "
                                        "trained with this run's tokenizer, or this run theirs (data.tokenizer, "
                                        "data.tokenizer_path)")  # fmt: skip
    if source is not None and source.model.lora.rank:
        return _merged(source, path, step, setup), path, step if step is not None else wd.saved_steps(path)[-1]
    directory = wd.checkpoint_dir(path) if wd.path(wd.checkpoint_dir(path)).is_dir() else path
    ckpt, abstract = Checkpointer(directory, read_only=True), abstract_params(setup.model, setup.shard)
    try:
        steps = ckpt.steps()
        if not steps:
            raise ConfigError(
                f"checkpoint.init_from={cfg.checkpoint.init_from!r}: {path} holds no checkpoint; give a run "
                "directory (or its checkpoints/ directory)."
            )
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise ConfigError(f"checkpoint.init_from: {path} has no checkpoint at step {step}; it has steps {steps}.")
        try:
            if not setup.adapted:
                return ckpt.restore_params(step, abstract), path, step
            base = frozen(abstract, setup.model)
            if not quantised.is_quantised(base):
                return ckpt.restore_params(step, base), path, step
            # A QLoRA base: the checkpoint's weights as trained, read into host memory, quantised onto the devices.
            floats = ckpt.restore_params(step, quantised.on_host(quantised.as_stored(base)))
            return quantised.quantise_tree(floats, base), path, step
        except Unreadable as e:
            if e.kind != faults.DAMAGED:
                raise StorageError(faults.stopped(f"checkpoint.init_from: {e.what}", e.error, e.kind, 0)) from e
            raise ConfigError(f"checkpoint.init_from: {e} (the checkpoint cannot be read).") from e
    finally:
        ckpt.close()


def _merged(source, path: str, step: int | None, setup) -> dict:
    """A LoRA run's weights (its checkpoints hold its adapters alone) as the model they make: its base with the
    adapters folded in, placed as this setup's parameters (the frozen base of new adapters, quantised where
    this setup's base is). `source`: the run's saved config, read here on this setup's mesh."""
    source = with_changes(source, {k: v for k, v in flatten(setup.cfg).items() if k.startswith("mesh.")})
    _, _, params = _restored(source, path, step, list(setup.mesh.devices.flat))
    lora = source.model.lora
    merged = adapters.fold(quantised.dequantised(params), lora.alpha / lora.rank)
    target = abstract_params(setup.model, setup.shard)
    if setup.adapted:
        target = frozen(target, setup.model)
        if quantised.is_quantised(target):
            target_floats = quantised.as_stored(target)
            _same_shapes(merged, target_floats, path)
            return quantised.quantise_tree(jax.device_get(merged), target)
    _same_shapes(merged, target, path)
    return jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), merged, target)


def _same_shapes(merged: dict, target: dict, path: str) -> None:
    have, want = ({n: s for n, (s, _) in arrays(t).items()} for t in (merged, target))
    for name in sorted(have.keys() | want.keys()):
        if have.get(name) != want.get(name):
            raise ConfigError(f"checkpoint.init_from={path!r}: its LoRA run's model has {name} of shape "
                              f"{have.get(name)} where this config's has {want.get(name)} (None = absent); use "
                              "a config of its model.")  # fmt: skip


def load_reference(cfg, setup, workdir: str, init: tuple | None) -> tuple[dict, str]:
    """DPO's reference: (the weights it started from, placed as the parameters are, as 'DIR@STEP').

    A new run's are a copy of its starting weights (`init`, which training then changes); a resumed run's
    are read again from the checkpoint its config.json pinned at its start, whatever init_from says now,
    so the reference never moves."""
    if init is not None:
        params, path, step = init
        if setup.adapted:  # the state holds the adapters alone: training never changes the base
            return params, f"{path}@{step}"
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params), f"{path}@{step}"
    saved = saved_config(workdir)
    pinned = saved.checkpoint.init_from if saved is not None and saved.checkpoint.init_from else None
    params, path, step = load_init_params(with_changes(cfg, {"checkpoint.init_from": pinned}) if pinned else cfg,
                                          setup)  # fmt: skip
    return params, f"{path}@{step}"


def load_params(cfg, workdir: str, step: int | None = None, devices=None) -> tuple[Setup, int, dict]:
    """(setup, step, params) of the newest checkpoint in `workdir`, or the one at `step`, for evaluation,
    generation and export: parameters only, straight into the shardings of the mesh the config asks for,
    and nothing in the workdir created, cleaned up or deleted (compiled programs go to train.compile_cache)."""
    compile_cache.use(compile_cache.place(cfg.train.compile_cache, workdir))
    return _restored(cfg, workdir, step, devices)


def _restored(cfg, workdir: str, step: int | None, devices) -> tuple[Setup, int, dict]:
    """load_params without choosing the compilation cache (a run's start reads another run's weights)."""
    setup = build(cfg, devices)
    check_architecture(workdir, cfg)
    steps = wd.saved_steps(workdir)
    if not steps:
        raise ConfigError(f"{workdir} holds no checkpoints; train there first, or pass the --workdir of a run.")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ConfigError(f"{workdir} has no checkpoint at step {step}; it has steps {steps}.")
    window = averaged_steps(cfg, workdir, steps, step)
    ckpt, abstract = Checkpointer(wd.checkpoint_dir(workdir), read_only=True), abstract_params(setup.model, setup.shard)
    try:
        target = trained(abstract, setup.model) if setup.adapted else abstract
        added = _moving_average(cfg, setup, ckpt, step, target) if cfg.checkpoint.read_ema else None
        added = added if added is not None else ckpt.restore_params(window[0], target)
        for s in window[1:]:  # one more tree on the devices at a time
            added = jax.tree.map(jnp.add, added, ckpt.restore_params(s, target))
        if len(window) > 1:
            added = jax.tree.map(lambda x: (x / len(window)).astype(x.dtype), added)
    finally:
        ckpt.close()
    if not setup.adapted:
        return setup, step, added
    base, _ = load_reference(cfg, setup, workdir, None)  # the frozen weights the run pinned at its start
    return setup, step, adapters.join(added, base)


def _moving_average(cfg, setup, ckpt: Checkpointer, step: int, target: dict) -> dict:
    """checkpoint.read_ema: the moving average of the weights that the checkpoint at `step` keeps in its optimiser
    state (trainer/optim/averaging.py), its moments never read; one sentence where it keeps none."""
    if not averaging.enabled(cfg.optim):
        raise ConfigError("checkpoint.read_ema reads the moving average that optim.ema_decay or "
                          "optim.ema_half_life_tokens keeps while training; this config sets neither (use the "
                          "run's own config).")  # fmt: skip
    ckpt.check_params(step, target)
    abstract = setup.abstract_state().opt_state
    if arrays(ckpt.metadata(step)[OPT_STATE]) != arrays(abstract):
        raise ConfigError(f"the optimiser state in the checkpoint at step {step} in {ckpt.directory} does not hold "
                          "this config's moving average of the weights; use the optim.* and precision.moments_dtype "
                          "the run was trained with.")  # fmt: skip
    keep = lambda p: any(getattr(k, "name", None) in averaging.FIELDS for k in p)  # noqa: E731
    return averaging.averaged(averaging.find(ckpt.restore_parts(step, abstract, keep)), target)


def averaged_steps(cfg, workdir: str, steps: list[int], step: int) -> list[int]:
    """The checkpoints whose weights are read for `step`: it alone, or under checkpoint.average_last=N the
    newest N at or before it; too few kept is one sentence."""
    n = cfg.checkpoint.average_last
    window = [s for s in steps if s <= step][-max(n, 1) :]
    if len(window) < n:
        raise ConfigError(f"checkpoint.average_last={n}: {workdir} keeps {len(window)} checkpoint(s) at or before "
                          f"step {step} ({window}); average at most {len(window)}, or keep more while training "
                          "(checkpoint.keep, checkpoint.keep_every).")  # fmt: skip
    return window


def starting_state(cfg, setup, workdir: str, restored: tuple | None, init: tuple | None, new_data, say) -> tuple:
    """(state, reset_optimizer, reset_label, data) a launch starts from: a restored checkpoint's, else fresh
    adapters beside the frozen base, else checkpoint.init_from's weights, else a new initialisation.
    `restored`: restore_state's (state, reset_optimizer, reset_label, data); `new_data()`: the data from its
    start."""
    if restored:
        if cfg.checkpoint.init_from and not (setup.preference or setup.adapted):  # their base is pinned
            say(f"checkpoint.init_from ignored: {workdir} holds checkpoints of its own; resuming them")
        return restored
    # A new run takes the asked reset label as done: there is no optimiser state to reset yet.
    fresh = (False, reset_label(cfg.checkpoint.reset_optimizer))
    if init is not None and setup.adapted:  # fresh adapters: B = 0, so the model starts as its base
        say(f"adapters start afresh beside the frozen weights of {init[1]} at step {init[2]} (init_from)")
        return setup.new_state(), *fresh, new_data()
    if init is not None:
        params, source, step = init
        state = state_from_params(params, setup.model, setup.tx, setup.shard, cfg.train.seed, setup.counters)
        say(f"started from the weights of {source} at step {step} (checkpoint.init_from); optimiser, schedule "
            "and data start afresh")  # fmt: skip
        return state, *fresh, new_data()
    return setup.new_state(), *fresh, new_data()
