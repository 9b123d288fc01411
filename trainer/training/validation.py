"""Every check that a config can work alone, before anything compiles or touches the disk.

`validate` judges the config alone (keys, values, and what the schedule, muP,
the batch ramp, the drills and the sharding rules need); trainer/training/mesh_fit.py
judges it against the mesh it will run on. Training, planning and evaluation all
pass through both (trainer/training/setup.py), so a bad config fails the same way
everywhere, with one sentence.
"""

from __future__ import annotations

import ml_collections

from parallelism.mesh import AXES
from parallelism.rules import check_rules, parse_rules
from trainer.config import (
    ATTENTION_IMPLS,
    CONTEXT_ATTENTION,
    DISTILL_MODES,
    DPO_LOSSES,
    DTYPES,
    FORMATS,
    LOSS_ON,
    LOSS_SCALING,
    MIXTURE_UNITS,
    OPTIMIZERS,
    RANGES,
    REMAT_POLICIES,
    RENAMED,
    RL_LOSSES,
    SCHEDULES,
    SOURCES,
    TOKEN_DTYPES,
    TOKENIZERS,
    TRACKERS,
    defaults,
    microbatch_size,
    renamed_words,
)
from trainer.config.errors import ConfigError
from trainer.config.forms import flatten
from trainer.config.layer_checks import check_layers
from trainer.config.layer_checks import choice as _choice
from trainer.config.unread import READ_ONLY_UNDER, READ_ONLY_WITH
from trainer.data.mixture import parse_mixture
from trainer.objectives import rewards
from trainer.optim import mup, schedules
from trainer.training import batch_ramp


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Raise ConfigError naming the first key that cannot work, before any device is asked."""
    known = flatten(defaults())
    for path, value in flatten(cfg).items():
        if path in RENAMED:
            raise ConfigError(f"config key '{path}' {renamed_words(path)}; use the new name.")
        if path not in known:
            raise ConfigError(f"unknown config key '{path}'; check its spelling against trainer/config/__init__.py.")
        default = known[path]
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{path}={value!r} must be a number.")
            if not in_range(value, RANGES[path]):
                raise ConfigError(f"{path}={value!r} must be {_said(RANGES[path])}.")
    missing = set(known) - set(flatten(cfg))
    if missing:
        raise ConfigError(
            f"config key '{sorted(missing)[0]}' is missing; start recipes from trainer.config.defaults()."
        )

    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    _choice("model.remat", m.remat, REMAT_POLICIES)
    _choice("model.attention", m.attention, ATTENTION_IMPLS)
    _choice("model.context_attention", m.context_attention, CONTEXT_ATTENTION)
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
    _choice("data.mixture_unit", d.mixture_unit, MIXTURE_UNITS)
    _choice("data.token_dtype", d.token_dtype, TOKEN_DTYPES)
    _choice("data.format", d.format, FORMATS)
    _choice("data.loss_on", d.loss_on, LOSS_ON)
    _choice("dpo.loss", cfg.dpo.loss, DPO_LOSSES)
    _check_post_training(cfg)
    _check_distill(cfg)
    if d.source in ("megatron", "dolma") and not d.paths:
        what = "the datasets' prefixes (without .bin or .idx)" if d.source == "megatron" else "globs of its .npy files"
        raise ConfigError(f"data.source={d.source} reads token files where they are: give data.paths, {what}.")
    if not m.head_dim and m.d_model % m.n_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not a multiple of model.n_heads={m.n_heads}; "
            "change one, or set model.head_dim."
        )
    head = m.head_dim or m.d_model // m.n_heads  # as Architecture resolves it
    if head % 2:
        raise ConfigError(f"the head size {head} (model.head_dim, or d_model/n_heads) must be even for RoPE.")
    r = m.rope_scaling
    if r.kind not in ("llama3", "yarn"):
        raise ConfigError(f"model.rope_scaling.kind={r.kind!r}; it is llama3 (Llama 3's) or yarn (YaRN's).")
    if r.factor != 1 and r.kind == "llama3" and r.high_freq_factor <= r.low_freq_factor:
        raise ConfigError(
            f"model.rope_scaling.high_freq_factor={r.high_freq_factor} must exceed low_freq_factor="
            f"{r.low_freq_factor} (Llama 3.1 uses 4 and 1)."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}; "
            "each key/value head must serve a whole group of query heads."
        )
    if m.loss_chunk and d.seq_len % m.loss_chunk:
        raise ConfigError(f"model.loss_chunk={m.loss_chunk} must be 0 or divide data.seq_len={d.seq_len}.")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}.")
    if t.global_batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} does not divide into "
            f"train.grad_accum_steps={t.grad_accum_steps} microbatches."
        )
    check_layers(cfg)  # first: a kind of layer that no pipeline setting fixes is said before the pipeline's own
    _check_pipeline(cfg)
    if cfg.stability.max_bad_steps > cfg.stability.bad_window:
        raise ConfigError(
            f"stability.max_bad_steps={cfg.stability.max_bad_steps} bad steps can never occur within "
            f"stability.bad_window={cfg.stability.bad_window} steps; lower it, or set 0 to roll back on no count of "
            "bad steps."
        )
    decay_steps = o.decay_steps if o.schedule in ("cosine", "linear") else 0  # the others never read it
    if o.warmup_steps + decay_steps > t.steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps}{f' + optim.decay_steps={decay_steps}' * bool(decay_steps)} "
            f"exceed{'s' * (not decay_steps)} train.steps={t.steps}; lower --config.optim.warmup_steps"
            f"{' or --config.optim.decay_steps' * bool(decay_steps)}, or raise --config.train.steps."
        )
    if o.ema_decay and o.ema_half_life_tokens:
        raise ConfigError(f"optim.ema_decay={o.ema_decay} and optim.ema_half_life_tokens={o.ema_half_life_tokens} "
                          "both set the moving average's decay; set one, not both.")  # fmt: skip
    if cfg.checkpoint.read_ema and cfg.checkpoint.average_last > 1:
        raise ConfigError(f"checkpoint.read_ema and checkpoint.average_last={cfg.checkpoint.average_last} each "
                          "choose the weights that are read; set one, not both.")  # fmt: skip
    if cfg.checkpoint.reset_optimizer and cfg.checkpoint.init_from:
        raise ConfigError(
            "checkpoint.reset_optimizer resumes this run and checkpoint.init_from starts a new one from another's "
            "weights; set one, not both."
        )
    if d.tokenizer == "sentencepiece" and not d.tokenizer_path:
        raise ConfigError(
            "data.tokenizer='sentencepiece' needs data.tokenizer_path; train one with scripts/train_tokenizer.py."
        )
    if d.tokenizer == "hf" and not d.tokenizer_path:
        raise ConfigError("data.tokenizer='hf' needs data.tokenizer_path: a tokenizer.json or a directory holding one.")
    schedules.check(cfg.optim, t.steps)
    mup.check(cfg)
    batch_ramp.check(cfg)
    _check_lists(cfg)
    check_rules(parse_rules(cfg.mesh.rules, cfg.mesh.sequence_parallel), AXES)


def unread_settings(cfg: ml_collections.ConfigDict) -> list[str]:
    """One line for each key set away from its default that the chosen optimizer, schedule, precision,
    tokenizer or experts never read (config.READ_ONLY_WITH, READ_ONLY_UNDER): a warning, since a recipe
    switched from the command line keeps its other keys."""
    from trainer.training.precision import LossScaling

    values, default = flatten(cfg), flatten(defaults())
    values["precision.loss_scaling"] = "dynamic" if LossScaling.from_config(cfg).dynamic else "none"
    lines, named = [], set()
    for key, setting in READ_ONLY_WITH.items():
        if values[key] != default[key] and not values[setting]:
            named.add(key)
            lines.append(f"{key}={values[key]!r} is read only when {setting} is not {values[setting]!r}; with "
                         f"{setting}={values[setting]!r} it does nothing.")  # fmt: skip
    for key, (setting, readers) in READ_ONLY_UNDER.items():
        if values[key] != default[key] and values[setting] not in readers and key not in named:
            chosen = values[setting]
            if setting == "precision.loss_scaling":
                chosen = f"{cfg.precision.loss_scaling} ({chosen} with {cfg.precision.compute_dtype} compute)"
            lines.append(
                f"{key}={values[key]!r} is read only when {setting} is {' or '.join(readers)}; with {setting}="
                f"{chosen} it does nothing."
            )
    return lines


def _check_lists(cfg) -> None:
    """The config's lists: drills and the profiling window."""
    dbg, window = cfg.debug, cfg.train.profile_steps
    for key in ("poison_batches", "flip_batches"):
        if not all(isinstance(b, int) and b >= 0 for b in dbg[key]):
            raise ConfigError(
                f"debug.{key}={dbg[key]!r} must be data batch numbers, e.g. --config.debug.{key}=12,13,14."
            )
    spike = dbg.lr_spike
    if spike and not (
        len(spike) == 3 and all(isinstance(x, (int, float)) for x in spike) and 0 <= spike[0] <= spike[1]
    ):
        raise ConfigError(
            f"debug.lr_spike={spike!r} must be (first batch, last batch, factor), e.g. "
            "--config.debug.lr_spike=20,27,1000."
        )
    if window and not (len(window) == 2 and all(isinstance(x, int) for x in window) and 1 <= window[0] <= window[1]):
        raise ConfigError(
            f"train.profile_steps={window!r} must be (first, last) with 1 <= first <= last, e.g. "
            "--config.train.profile_steps=10,12."
        )
    _check_watching(cfg)
    if cfg.data.tokenized and cfg.data.source != "text_files":
        what = " (Megatron's and Dolma's files hold tokens already)" * (cfg.data.source in ("megatron", "dolma"))
        raise ConfigError(
            f"data.tokenized reads a text_files corpus's tokenised cache{what}; set data.source=text_files."
        )
    if parse_mixture(cfg.data.mixture) and cfg.data.source == "synthetic":
        raise ConfigError("data.mixture draws from prepared corpora; use data.source=text_files or tfds.")


def _check_watching(cfg: ml_collections.ConfigDict) -> None:
    """Trackers and samples: what a run shows while it goes."""
    t = cfg.train
    for name in t.trackers:
        _choice("train.trackers", name, TRACKERS)
    if "wandb" in t.trackers:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError('train.trackers has wandb, which is not installed: pip install -e ".[wandb]".')


def _check_post_training(cfg) -> None:
    """Conversations are prepared from files, one corpus for DPO; DPO needs its reference weights."""
    d = cfg.data
    if d.format == "text":
        return
    one = d.format == "preference"
    if d.source != "text_files" or (d.mixture and one):
        raise ConfigError(
            f"data.format={d.format} reads .jsonl or .parquet rows prepared here: set data.source=text_files and "
            f"give data.paths{' (one corpus: no data.mixture)' * one}."
        )
    if d.format == "prompts":
        _check_rl(cfg)
    if d.format == "preference" and not cfg.checkpoint.init_from:
        raise ConfigError(
            "DPO (data.format=preference) measures the policy against the weights it starts from: give them with "
            "--config.checkpoint.init_from=DIR[@STEP] (a trained or imported run)."
        )
    if d.format == "preference" and cfg.mesh.stage > 1:
        raise ConfigError("DPO runs without pipeline stages: set mesh.stage=1.")


def _check_distill(cfg) -> None:
    """What distillation (distill.teacher, trainer/objectives/distill.py) runs with; the teacher itself is
    checked where it is read (trainer/training/teacher.py)."""
    d = cfg.distill
    if not d.teacher:
        return
    _choice("distill.mode", d.mode, DISTILL_MODES)
    objective = {"preference": "DPO", "prompts": "GRPO"}.get(cfg.data.format)
    others = [(objective, f"data.format={cfg.data.format} ({objective}'s own objective)"),
              (cfg.mesh.stage > 1, f"mesh.stage={cfg.mesh.stage} (pipeline stages)"),
              (cfg.mesh.context != 1, f"mesh.context={cfg.mesh.context}"),
              (cfg.model.mtp.depth, f"model.mtp.depth={cfg.model.mtp.depth} (multi-token prediction)")]  # fmt: skip
    for on, what in others:
        if on:
            raise ConfigError(f"distill.teacher with {what} is not supported: distil on text or chat data "
                              "(data.format=text or chat), without it.")  # fmt: skip
    if d.on_policy and (d.mode != "online" or cfg.data.format != "text"):
        why = (
            "distill.mode=online (the teacher scores what the student samples"
            if d.mode != "online"
            else (f"text data (the student continues each text row; data.format={cfg.data.format}")
        )
        raise ConfigError(f"distill.on_policy={d.on_policy} needs {why}); set it, or distill.on_policy=0.")
    if d.mode == "offline" and d.top_k > cfg.model.vocab_size:
        raise ConfigError(f"distill.top_k={d.top_k} exceeds the vocabulary (model.vocab_size="
                          f"{cfg.model.vocab_size}); keep at most the whole of it.")  # fmt: skip


def _check_rl(cfg) -> None:
    """GRPO's settings (data.format=prompts), and its rewards importable, before anything compiles."""
    rl, t = cfg.rl, cfg.train
    _choice("rl.loss", rl.loss, RL_LOSSES)
    if cfg.data.mixture and cfg.data.mixture_unit != "documents":
        raise ConfigError(f"data.mixture_unit={cfg.data.mixture_unit}: a mixture of prompts corpora draws prompts, "
                          "its weights are shares of the prompts; set data.mixture_unit=documents.")  # fmt: skip
    if rl.group_size < 2:
        raise ConfigError(f"rl.group_size={rl.group_size}: GRPO compares a prompt's completions with each other, and "
                          "one alone has an advantage of 0 (nothing to learn); sample at least 2.")  # fmt: skip
    if t.global_batch_size % rl.group_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} (completions a step) is not a multiple of "
                          f"rl.group_size={rl.group_size}; make it one (prompts x group_size).")  # fmt: skip
    if rl.max_new_tokens >= cfg.data.seq_len:
        raise ConfigError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in data.seq_len="
                          f"{cfg.data.seq_len}; raise data.seq_len or lower rl.max_new_tokens.")  # fmt: skip
    if rl.beta > 0 and not cfg.checkpoint.init_from:
        raise ConfigError(f"rl.beta={rl.beta} pulls the policy towards a reference, the weights it starts from: give "
                          "them with --config.checkpoint.init_from=DIR[@STEP], or set rl.beta=0.")  # fmt: skip
    if cfg.mesh.stage > 1 or cfg.data.workers:
        raise ConfigError("reinforcement learning (data.format=prompts) runs without pipeline stages or data "
                          "workers: set mesh.stage=1 and data.workers=0.")  # fmt: skip
    if cfg.checkpoint.every_steps % rl.updates_per_batch:
        raise ConfigError(f"checkpoint.every_steps={cfg.checkpoint.every_steps} is not a multiple of "
                          f"rl.updates_per_batch={rl.updates_per_batch}: a checkpoint inside a rollout's updates "
                          "cannot resume them exactly; make it one.")  # fmt: skip
    rewards.load(rl)


def _check_pipeline(cfg: ml_collections.ConfigDict) -> None:
    stages, m = cfg.mesh.stage, cfg.train.pipeline_microbatches
    if stages == 1:
        if m != 1:
            raise ConfigError(
                f"train.pipeline_microbatches={m} only applies to a pipeline; set mesh.stage > 1 or leave it 1."
            )
        return
    if cfg.model.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} does not split into mesh.stage={stages} equal stages; "
            f"use a stage count that divides {cfg.model.n_layers}."
        )
    if m < stages:
        raise ConfigError(
            f"train.pipeline_microbatches={m} is fewer than mesh.stage={stages}, so stages would sit idle; "
            f"use at least {stages} (4 x {stages} = {4 * stages} keeps the bubble under 20%)."
        )
    micro = microbatch_size(cfg)
    if micro % m:
        raise ConfigError(
            f"a batch of {micro} sequences (train.global_batch_size / train.grad_accum_steps) does not "
            f"split into train.pipeline_microbatches={m} pipeline microbatches; make it a multiple of {m}."
        )


def in_range(value, spec: str) -> bool:
    """Whether `value` lies in a range written as config.Num writes them: "(0, inf)", "-1 or [1, inf)"."""
    for part in spec.split(" or "):
        if part[0] not in "[(":
            if value == float(part):
                return True
            continue
        low, high = (float(x) for x in part[1:-1].split(","))
        above = value >= low if part[0] == "[" else value > low
        below = value <= high if part[-1] == "]" else value < high
        if above and below:  # nan is in no range
            return True
    return False


def _said(spec: str) -> str:
    """A range as a sentence's end: "in (0, inf)", "-1 or in [1, inf)"."""
    return " or ".join(part if part[0] not in "[(" else f"in {part}" for part in spec.split(" or "))
