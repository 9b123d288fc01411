"""Every config key and its default, and the few things computed from keys alone.

Recipes in `configs/` start from `defaults()` and change what they need. The
returned dict is locked, so a misspelt key in a recipe or on the command line
(`--config.optim.lrr=1`) is refused by name instead of silently ignored; a key
that was renamed is refused with its new name. Lists are tuples: on the command
line `--config.debug.poison_batches=12,13` or `--config.mesh.rules.batch=data,fsdp`
(`command_line_lists` splits what the flag parser leaves as one string). The
checks that a config can work live in trainer/validation.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping

import ml_collections

from parallelism.rules import DEFAULT_RULES

REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch")
OPTIMIZERS = ("adamw", "lion", "adafactor", "sgd", "muon")
LOSS_SCALING = ("auto", "dynamic", "none")
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "splash", "auto")
SCHEDULES = ("cosine", "wsd", "linear", "constant")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("text_files", "tfds", "synthetic")
TOKENIZERS = ("byte", "sentencepiece", "hf")
TRACKERS = ("tensorboard", "wandb")
MIXTURE_UNITS = ("tokens", "documents")


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
    # places each logical axis on mesh axes (a tuple; () replicates), e.g.
    # --config.mesh.rules.embed=tensor or --config.mesh.rules.vocab=.
    c.mesh = dict(
        stage=1,  # pipeline stages: the stacked layers split into this many blocks (GPipe)
        data=1,
        fsdp=-1,
        tensor=1,
        dcn_data=1,  # slices (TPU slices or hosts) the data axis spans; sizes above are per slice
        dcn_fsdp=1,
        sequence_parallel=False,  # shard the residual stream's sequence axis over tensor between blocks
        rules=dict(DEFAULT_RULES),
    )
    c.data = dict(
        source="text_files",  # one of SOURCES
        name="python_stdlib",  # TFDS dataset name (text_files: the corpus name)
        paths="",  # text_files: comma-separated globs; "" = this Python's standard library
        data_dir="",  # where prepared datasets live; "" = ~/tensorflow_datasets
        text_key="text",  # the text's feature (tfds), field (JSON lines) or column (Parquet)
        train_split="train",
        eval_split="validation",
        tokenizer="byte",  # one of TOKENIZERS
        tokenizer_path="",  # sentencepiece: a .model file (scripts/train_tokenizer.py); hf: a tokenizer.json or its dir
        seq_len=256,
        packing="concat",  # documents concatenated and split into seq_len windows
        mixture=(),  # ("corpus:weight", ...): train on these prepared corpora of `source`, drawn by weight
        mixture_unit="tokens",  # one of MIXTURE_UNITS: what a mixture's weights are shares of
        validation_fraction=0.02,  # text_files: the share of documents held out (by a hash of each one's place)
        tokenized=False,  # text_files: read the corpus's tokenised cache (made once), no tokenizer in the loop
        workers=0,  # processes that read and tokenise the batch rows; 0 = a thread of the training process
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
        pipeline_microbatches=1,  # a pipeline cuts each microbatch into these; >= mesh.stage when pipelining
        seed=0,
        log_every=10,
        eval_every=200,  # 0 disables validation
        eval_batches=4,
        ramp_batch_size=0,  # > 0: start at this global batch and grow to global_batch_size ...
        ramp_tokens=0,  # ... over this many tokens (the schedule counts tokens either way)
        layer_grad_norms=False,  # also log each layer's gradient norm
        profile_steps=(),  # (first, last): a jax.profiler trace of those steps in <workdir>/profile
        trackers=("tensorboard",),  # of TRACKERS, besides metrics.jsonl (always written)
        wandb_project="trainer",  # the W&B project a `wandb` tracker logs to (entity, mode: WANDB_* variables)
        sample_prompts=(),  # at each evaluation (none without one), complete these greedily and sampled
        sample_tokens=64,  # tokens generated per sample
        # No step, evaluation batch or checkpoint for this long: write every thread's stack and end the run
        # (all its processes), so that the scheduler relaunches it (trainer/training/hang.py); 0 = never.
        hang_seconds=1800.0,
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
        poison_batches=(),  # these data batches yield a non-finite loss and gradients (a drill)
        lr_spike=(),  # (first, last, factor): data batches first..last train at factor x the learning rate
    )
    # Keep the newest `keep`, plus every multiple of `keep_every` (0 = none).
    # `async` is a Python keyword: read it as cfg.checkpoint["async"].
    c.checkpoint = {
        "every_steps": 500,
        "keep": 3,
        "keep_every": 0,
        "async": True,
        # A restore (or a bucket at start-up) whose storage answers 429/5xx or times out is retried this long.
        "retry_seconds": 300,
        # A label ("" = none) asking to resume this run's weights, step, schedule and data with a fresh optimiser
        # state (e.g. another optim.name). Each new label resets once ("true" for a first, e.g. a date for each
        # later one); the same label again, as a relaunch has it, resumes the state it reset to.
        "reset_optimizer": "",
        # "DIR[@STEP]": start a new run from another run's weights, everything else fresh (fine-tuning).
        "init_from": "",
    }
    c.lock()
    return c


# Keys that were renamed: refused with their new name, and read from an older run's config.json.
RENAMED = {"train.microbatches": "train.pipeline_microbatches"}
# Keys added with a default that differs from what runs did before them: an older run's config.json, which
# lacks the key, is read with the value that run had in effect.
BEFORE = {"data.mixture_unit": "documents"}


def _walk(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, Mapping)):
            yield from _walk(value, path + ".")
        else:
            yield path, value


def microbatch_size(cfg) -> int:
    """Sequences in one microbatch: what a step computes at once (train.grad_accum_steps of them make a batch)."""
    return cfg.train.global_batch_size // cfg.train.grad_accum_steps


def command_line_lists(cfg: ml_collections.ConfigDict) -> None:
    """Split, in place, what the flag parser leaves of a list as one string ('data,fsdp' -> ('data', 'fsdp'),
    '' -> ()); numbers arrive as tuples already."""
    for key, value in flatten(cfg).items():
        if isinstance(value, tuple) and any(isinstance(v, str) and ("," in v or not v) for v in value):
            parts = tuple(p.strip() for v in value for p in str(v).split(",") if p.strip())
            with_changes(cfg, {key: parts}, in_place=True)


def to_json(cfg: ml_collections.ConfigDict) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


def flatten(cfg) -> dict[str, object]:
    """{"section.key": value} for every key (nested dicts such as mesh.rules flattened too)."""
    return dict(_walk(cfg))


def with_changes(cfg: ml_collections.ConfigDict, changes: Mapping[str, object], in_place: bool = False):
    """`cfg` (a copy, unless `in_place`) with dotted keys changed: with_changes(cfg, {"optim.lr": 1e-3})."""
    out = cfg if in_place else copy.deepcopy(cfg)
    for key, value in changes.items():
        *parents, name = key.split(".")
        node = out
        for part in parents:
            node = node[part]
        node[name] = value
    return out


def from_dict(saved: Mapping) -> ml_collections.ConfigDict:
    """A config from a saved config.json: today's defaults, overwritten by every key the file knows.

    Renamed keys are read under their new names; keys an older trainer wrote
    and this one no longer has are dropped; keys it did not have yet keep their
    defaults, or what its runs did before them (BEFORE); JSON's lists become the
    tuples they were.
    """
    known = flatten(defaults())
    values = {**BEFORE, **{RENAMED.get(k, k): v for k, v in _walk(saved)}}
    values = {k: _as_tuple(v) if isinstance(known[k], tuple) else v for k, v in values.items() if k in known}
    # A flag that became a label (checkpoint.reset_optimizer): true is the label "true".
    values = {k: ("true" if v else "") if isinstance(known[k], str) and isinstance(v, bool) else v
              for k, v in values.items()}  # fmt: skip
    return with_changes(defaults(), values)


def _as_tuple(value) -> tuple:
    """A list from JSON, or the comma-separated string an older trainer kept a list in."""
    if not isinstance(value, str):
        return tuple(value)

    def parsed(part):
        for kind in (int, float):
            try:
                return kind(part)
            except ValueError:
                pass
        return part

    return tuple(parsed(p.strip()) for p in value.split(",") if p.strip())
