"""Every config key, its default, and the checks that run before anything compiles.

Recipes in `configs/` start from `defaults()` and change what they need. The
returned dict is locked, so a misspelt key in a recipe or on the command line
(`--config.optim.lrr=1`) is refused by name instead of silently ignored.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping

import ml_collections

from parallelism.rules import DEFAULT_RULES
from trainer.errors import ConfigError

REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch")
OPTIMIZERS = ("adamw", "lion", "adafactor", "sgd", "muon")
LOSS_SCALING = ("auto", "dynamic", "none")
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn")
SCHEDULES = ("cosine", "wsd", "linear", "constant")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("text_files", "tfds", "synthetic")
TOKENIZERS = ("byte", "sentencepiece")


def defaults() -> ml_collections.ConfigDict:
    """The single home of every key and its default value."""
    c = ml_collections.ConfigDict()

    c.model = dict(
        vocab_size=384,  # >= tokenizer size; a multiple of 128 shards evenly over tensor
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,  # grouped-query attention: n_heads must be a multiple
        d_ff=768,
        max_seq_len=256,
        rope_theta=10_000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        remat="none",  # one of REMAT_POLICIES
        scan_layers=True,
        attention="xla",  # one of ATTENTION_IMPLS
        init_std=0.02,
        mup_base_width=0,  # > 0: muP, with hyperparameters tuned at this d_model
        loss_chunk=0,  # > 0: the loss makes logits this many positions at a time (less memory, one more matmul)
    )
    # Each size is a device count (within a slice) or -1 for "the rest". `rules`
    # places each logical axis on mesh axes ("data,fsdp"; "" replicates), e.g.
    # --config.mesh.rules.embed=tensor.
    c.mesh = dict(
        stage=1,  # pipeline stages: the stacked layers split into this many blocks (GPipe)
        data=1,
        fsdp=-1,
        tensor=1,
        dcn_data=1,  # slices (TPU slices or hosts) the data axis spans; sizes above are per slice
        dcn_fsdp=1,
        sequence_parallel=False,  # shard the residual stream's sequence axis over tensor between blocks
        rules={name: ",".join(axes) for name, axes in DEFAULT_RULES.items()},
    )
    c.data = dict(
        source="text_files",  # one of SOURCES
        name="python_stdlib",  # TFDS dataset name (text_files: the corpus name)
        paths="",  # text_files: comma-separated globs; "" = this Python's standard library
        data_dir="",  # where prepared datasets live; "" = ~/tensorflow_datasets
        text_key="text",  # tfds: the feature holding the text
        train_split="train",
        eval_split="validation",
        tokenizer="byte",  # one of TOKENIZERS
        tokenizer_path="",  # sentencepiece model file (scripts/train_tokenizer.py writes one)
        seq_len=256,
        packing="concat",  # documents concatenated and split into seq_len windows
    )
    c.optim = dict(
        name="adamw",  # one of OPTIMIZERS; muon uses AdamW for embeddings, norms and the head
        lr=3e-4,
        schedule="cosine",  # one of SCHEDULES
        warmup_steps=100,
        decay_steps=0,  # cosine/linear: steps of decay after warmup; 0 = to the end of training
        decay_fraction=0.2,  # wsd: the last fraction of training spent decaying
        decay_shape="linear",  # wsd: linear or cosine decay
        min_lr_ratio=0.1,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,  # 0 disables clipping
        momentum=0.9,  # sgd
        z_loss=0.0,  # weight of log(Z)^2, which keeps the logits' normaliser near 1
    )
    c.precision = dict(
        param_dtype="float32",
        compute_dtype="bfloat16",
        loss_scaling="auto",  # dynamic for float16 compute, none otherwise
        initial_loss_scale=2.0**15,
        loss_scale_growth_interval=2000,  # good steps before the scale doubles
        moments_dtype="float32",  # optimiser moments; bfloat16 halves their memory
    )
    c.train = dict(
        steps=1000,
        global_batch_size=32,  # sequences per optimiser update, over all devices and microbatches
        grad_accum_steps=1,
        microbatches=1,  # pipeline microbatches per accumulation step; >= mesh.stage when pipelining
        seed=0,
        log_every=10,
        eval_every=200,  # 0 disables validation
        eval_batches=4,
        ramp_batch_size=0,  # > 0: start at this global batch and grow to global_batch_size ...
        ramp_tokens=0,  # ... over this many tokens (the schedule counts tokens either way)
        layer_grad_norms=False,  # also log each layer's gradient norm
        profile_steps="",  # "first,last": a jax.profiler trace of those steps in <workdir>/profile
    )
    # Bad steps (non-finite, or a gradient-norm spike) are skipped; too many in a
    # window, or a loss that stays diverged, rolls back to the last healthy checkpoint.
    c.stability = dict(
        spike_factor=10.0,  # a gradient norm above this x its running mean is a spike (0 = off)
        stats_warmup=20,  # steps of statistics before spikes are judged
        max_bad_steps=4,  # bad steps within `bad_window` that trigger a rollback
        bad_window=50,
        diverge_factor=2.0,  # loss above this x its running mean ...
        diverge_steps=20,  # ... for this many steps in a row triggers a rollback (0 = off)
        rollback_lr_factor=0.5,  # learning rate multiplied by this at each rollback
        max_rollbacks=3,
    )
    c.debug = dict(
        poison_batches="",  # "i,j,...": these data batches yield non-finite gradients (a drill)
        lr_spike="",  # "first:last:factor": data batches first..last train at factor x the learning rate
    )
    # Keep the newest `keep`, plus every multiple of `keep_every` (0 = none).
    # `async` is a Python keyword: read it as cfg.checkpoint["async"].
    c.checkpoint = {
        "every_steps": 500,
        "keep": 3,
        "keep_every": 0,
        "async": True,
        # Resume this run's weights, step, schedule and data with a fresh optimiser state (e.g. another optim.name).
        "reset_optimizer": False,
        # "DIR[@STEP]": start a new run from another run's weights, everything else fresh (fine-tuning).
        "init_from": "",
    }
    c.lock()
    return c


def _walk(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, Mapping)):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raise ConfigError naming the first key that cannot work; devices are checked elsewhere."""
    known = dict(_walk(defaults()))
    for path, value in _walk(cfg):
        if path not in known:
            raise ConfigError(f"unknown config key '{path}'; check its spelling against trainer/config.py.")
        default = known[path]
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{path}={value!r} must be a number.")
    missing = set(known) - {p for p, _ in _walk(cfg)}
    if missing:
        raise ConfigError(
            f"config key '{sorted(missing)[0]}' is missing; start recipes from trainer.config.defaults()."
        )

    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    _choice("model.remat", m.remat, REMAT_POLICIES)
    _choice("model.attention", m.attention, ATTENTION_IMPLS)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("precision.loss_scaling", cfg.precision.loss_scaling, LOSS_SCALING)
    _choice("precision.moments_dtype", cfg.precision.moments_dtype, ("float32", "bfloat16"))
    _choice("optim.decay_shape", o.decay_shape, ("linear", "cosine"))
    _choice("precision.param_dtype", cfg.precision.param_dtype, ("float32",))
    _choice("precision.compute_dtype", cfg.precision.compute_dtype, DTYPES)
    _choice("data.source", d.source, SOURCES)
    _choice("data.tokenizer", d.tokenizer, TOKENIZERS)
    _choice("data.packing", d.packing, ("concat",))
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
        _positive(f"model.{key}", m[key])
    for key in ("steps", "global_batch_size", "grad_accum_steps", "microbatches", "log_every", "eval_batches"):
        _positive(f"train.{key}", t[key])
    _positive("data.seq_len", d.seq_len)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not a multiple of model.n_heads={m.n_heads}.")
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(f"the head size d_model/n_heads={m.d_model // m.n_heads} must be even for rotary embeddings.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}; "
            "each key/value head must serve a whole group of query heads."
        )
    if m.loss_chunk < 0 or (m.loss_chunk and d.seq_len % m.loss_chunk):
        raise ConfigError(f"model.loss_chunk={m.loss_chunk} must be 0 or divide data.seq_len={d.seq_len}.")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}.")
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} does not divide into "
            f"train.grad_accum_steps={t.grad_accum_steps} microbatches."
        )
    _check_pipeline(cfg)
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1].")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must lie in (0, 1].")
    if o.warmup_steps < 0 or o.decay_steps < 0 or t.eval_every < 0 or cfg.checkpoint.keep_every < 0:
        raise ConfigError(
            "optim.warmup_steps, optim.decay_steps, train.eval_every and checkpoint.keep_every cannot be negative."
        )
    if o.warmup_steps + o.decay_steps > t.steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} + optim.decay_steps={o.decay_steps} exceed "
            f"train.steps={t.steps}; shorten the schedule or train longer."
        )
    if cfg.checkpoint.reset_optimizer and cfg.checkpoint.init_from:
        raise ConfigError(
            "checkpoint.reset_optimizer resumes this run and checkpoint.init_from starts a new one from another's "
            "weights; set one, not both."
        )
    if d.tokenizer == "sentencepiece" and not d.tokenizer_path:
        raise ConfigError(
            "data.tokenizer='sentencepiece' needs data.tokenizer_path; train one with scripts/train_tokenizer.py."
        )


def _check_pipeline(cfg: ml_collections.ConfigDict) -> None:
    stages, m = cfg.mesh.stage, cfg.train.microbatches
    if stages < 1:
        raise ConfigError(f"mesh.stage={stages} must be a positive number of pipeline stages.")
    if stages == 1:
        if m != 1:
            raise ConfigError(f"train.microbatches={m} only applies to a pipeline; set mesh.stage > 1 or leave it 1.")
        return
    if cfg.model.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} does not split into mesh.stage={stages} equal stages; "
            f"use a stage count that divides {cfg.model.n_layers}."
        )
    if m < stages:
        raise ConfigError(
            f"train.microbatches={m} is fewer than mesh.stage={stages}, so stages would sit idle; "
            f"use at least {stages} (4 x {stages} = {4 * stages} keeps the bubble under 20%)."
        )
    micro = microbatch_size(cfg)
    if micro % m:
        raise ConfigError(
            f"a batch of {micro} sequences (train.global_batch_size / train.grad_accum_steps) does not "
            f"split into train.microbatches={m} pipeline microbatches; make it a multiple of {m}."
        )


def microbatch_size(cfg) -> int:
    """Sequences in one microbatch: what a step computes at once (train.grad_accum_steps of them make a batch)."""
    return cfg.train.global_batch_size // cfg.train.grad_accum_steps


def check_mesh_fit(cfg: ml_collections.ConfigDict, mesh) -> None:
    """Refuse a batch or head count that does not divide over the mesh."""
    data_ways = mesh.shape["data"] * mesh.shape["fsdp"]
    tensor = mesh.shape["tensor"]
    micro = microbatch_size(cfg)
    if micro % data_ways:
        raise ConfigError(
            f"each microbatch of {micro} sequences (train.global_batch_size / train.grad_accum_steps) "
            f"does not divide over data x fsdp = {data_ways} devices; make it a multiple of {data_ways}."
        )
    piece = micro // cfg.train.microbatches
    if piece % data_ways:
        raise ConfigError(
            f"each pipeline microbatch of {piece} sequences does not divide over data x fsdp = "
            f"{data_ways} devices; use fewer train.microbatches or a larger batch."
        )
    for key in ("n_heads", "n_kv_heads"):
        if cfg.model[key] % tensor:
            raise ConfigError(
                f"model.{key}={cfg.model[key]} does not divide over mesh.tensor={tensor}; "
                f"use a tensor size that divides {cfg.model[key]}."
            )
    for key in ("d_ff", "vocab_size"):
        if cfg.model[key] % tensor:
            raise ConfigError(f"model.{key}={cfg.model[key]} does not divide over mesh.tensor={tensor}.")
    if cfg.model.d_model % mesh.shape["fsdp"]:
        raise ConfigError(f"model.d_model={cfg.model.d_model} does not divide over mesh.fsdp={mesh.shape['fsdp']}.")


def _choice(path: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(map(str, valid))}.")


def _positive(path: str, value) -> None:
    if value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"{path}={value} must be positive.")


def to_json(cfg: ml_collections.ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def flatten(cfg) -> dict[str, object]:
    """{"section.key": value} for every key (nested dicts such as mesh.rules flattened too)."""
    return dict(_walk(cfg))


def with_changes(cfg: ml_collections.ConfigDict, changes: Mapping[str, object]) -> ml_collections.ConfigDict:
    """A copy of `cfg` with dotted keys changed: with_changes(cfg, {"optim.lr": 1e-3})."""
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        *parents, name = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node[name] = value
    return out


def from_dict(saved: Mapping) -> ml_collections.ConfigDict:
    """A config from a saved config.json: today's defaults, overwritten by every key the file knows.

    Keys an older trainer wrote and this one no longer has are dropped; keys it
    did not have yet keep their defaults.
    """
    known = flatten(defaults())
    return with_changes(defaults(), {k: v for k, v in _walk(saved) if k in known})
