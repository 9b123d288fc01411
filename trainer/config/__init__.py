"""Every config key and its default, and the few things computed from keys alone.

Recipes in `configs/` start from `defaults()` and change what they need. A
number's range stands beside its default (Num), so no key is without one. The
returned dict is locked, so a misspelt key in a recipe or on the command line
(`--config.optim.lrr=1`) is refused by name instead of silently ignored; a key
that was renamed is refused with its new name. Lists are tuples: on the command
line `--config.debug.poison_batches=12,13` or `--config.mesh.rules.batch=data,fsdp`
(trainer/run/cli.py splits what the flag parser leaves as one string). The
checks that a config can work live in trainer/training/validation.py.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import ml_collections

from parallelism.rules import DEFAULT_RULES

REMAT_POLICIES = ("none", "full", "save_dots", "save_dots_no_batch")
OPTIMIZERS = ("adamw", "lion", "adafactor", "sgd", "muon")
LOSS_SCALING = ("auto", "dynamic", "none")
ATTENTION_IMPLS = ("xla", "dot_product", "cudnn", "splash", "auto")
CONTEXT_ATTENTION = ("ring", "all_gather")
SCHEDULES = ("cosine", "wsd", "linear", "constant")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("text_files", "tfds", "synthetic", "megatron", "dolma")
TOKEN_DTYPES = ("uint16", "uint32")  # data.token_dtype: Dolma's token files (trainer/data/readers/dolma.py)
TOKENIZERS = ("byte", "sentencepiece", "hf")
TRACKERS = ("tensorboard", "wandb")
MIXTURE_UNITS = ("tokens", "documents")
MOE_IMPLS = ("dropless", "capacity")
FORMATS = ("text", "chat", "preference", "prompts")  # data.format (trainer/data/chat.py)
LOSS_ON = ("all", "assistant", "last_turn")  # data.loss_on
DPO_LOSSES = ("sigmoid", "ipo")
RL_LOSSES = ("grpo", "dr_grpo")  # rl.loss (trainer/objectives/grpo.py)
DISTILL_MODES = ("online", "offline")  # distill.mode (trainer/objectives/distill.py)
RL_KEYS = ("reward", "reward_weights", "format_regex", "group_size", "max_new_tokens", "temperature", "top_p",
           "epsilon", "updates_per_batch", "beta", "loss")  # fmt: skip
# model.lora.targets (trainer/model/spec.py Adapters); new ones go last: a target's place seeds its dropout
ADAPTER_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "z", "out")
ADAPTER_BASES = ("", "int8", "nf4")  # model.lora.base
QUANT_MATMULS = ("", "int8", "fp8")  # model.quant.matmul (trainer/model/low_precision.py)
QUANT_TARGETS = ("attention", "mlp", "experts", "logits")  # model.quant.targets
LAYER_TYPES = ("linear_attention", "full_attention")  # model.layer_types (transformers' names)
ACTIVATIONS = ("silu", "gelu_tanh")  # model.mlp_activation: SwiGLU's gate, or GeGLU's (Gemma)
GROUPED_MATMULS = ("auto", "ragged_dot", "megablox")
ROUTERS = (
    "softmax",
    "sigmoid",
)  # model.moe.router (trainer/model/moe.py route)  # model.moe.grouped_matmul (trainer/model/moe.py)


class Num(NamedTuple):
    """A numeric key's default and the values it may take: intervals ("[0, 1)", "(0, inf)") and single
    values, joined by "or" ("-1 or [1, inf)"). validate() refuses a value outside, naming this range."""

    default: int | float
    range: str


def _declared() -> dict[str, dict]:
    """Every key: its default, and for a number its range (Num), section by section."""
    c = types.SimpleNamespace()

    c.model = dict(
        vocab_size=Num(384, "[1, inf)"),  # >= tokenizer size; a multiple of 128 shards evenly over tensor
        d_model=Num(256, "[1, inf)"),
        n_layers=Num(4, "[1, inf)"),
        n_heads=Num(8, "[1, inf)"),
        n_kv_heads=Num(4, "[1, inf)"),  # grouped-query attention: n_heads must be a multiple
        d_ff=Num(768, "[1, inf)"),
        head_dim=Num(0, "[0, inf)"),  # each attention head's width; 0 = d_model / n_heads (Qwen3 sets its own)
        max_seq_len=Num(256, "[1, inf)"),
        rope_theta=Num(10_000.0, "(1, inf)"),
        # RoPE's scaling for long context (factor 1: none): llama3 (Llama 3's: wavelengths past original_max_len /
        # low_freq_factor stretched by `factor`, below / high_freq_factor kept) or yarn (YaRN's: by turns over
        # original_max_len, beta_slow to beta_fast; temperature mscale, mscale_all_dim): spec.py RopeScaling.
        rope_scaling=dict(
            factor=Num(1.0, "[1, inf)"),
            low_freq_factor=Num(1.0, "(0, inf)"),
            high_freq_factor=Num(4.0, "(0, inf)"),
            original_max_len=Num(8192, "[1, inf)"),
            kind="llama3",
            beta_fast=Num(32.0, "(0, inf)"),
            beta_slow=Num(1.0, "(0, inf)"),
            mscale=Num(0.0, "[0, inf)"),
            mscale_all_dim=Num(0.0, "[0, inf)"),
            truncate=True,
        ),
        norm_eps=Num(1e-5, "(0, inf)"),
        qk_norm=False,  # RMSNorm each query and key head before RoPE (Qwen3's attention)
        tie_embeddings=False,
        # Sliding-window attention (trainer/model/attention.py): a local layer's query sees itself and the
        # sliding_window - 1 tokens before it; 0 = every layer global.
        sliding_window=Num(0, "[0, inf)"),
        global_every=Num(0, "[0, inf)"),  # with a window: every this-many-th layer global (Gemma 3: 6); 0 = none
        attention_sinks=False,  # each head's learned logit of a valueless key (gpt-oss): xla and splash kernels
        local_rope_theta=Num(0.0, "0 or (1, inf)"),  # the local layers' RoPE base (Gemma 3: 10000); 0 = rope_theta
        # Gemma's details: embeddings x sqrt(d_model); a norm on each sublayer's output before the residual add;
        # the MLP's gate activation (one of ACTIVATIONS); attention scores x attn_scale_dim^-0.5 (0 = head_dim).
        embed_scale=False,
        post_norms=False,
        mlp_activation="silu",
        attn_scale_dim=Num(0, "[0, inf)"),
        # Hybrids (Qwen3.5, Qwen3-Next; trainer/model/delta.py): each layer's kind, one of LAYER_TYPES, n_layers
        # of them ((): every layer full attention); the linear ones' Gated DeltaNet shapes in `linear`. Their
        # full-attention layers rotate the first rope_fraction of each head and gate its output
        # (attention_gate: times sigmoid of a per-head gate the query projection gives beside the query).
        layer_types=(),
        linear=dict(
            key_heads=Num(16, "[1, inf)"),
            value_heads=Num(32, "[1, inf)"),  # a multiple of key_heads
            key_dim=Num(128, "[1, inf)"),
            value_dim=Num(128, "[1, inf)"),
            conv_kernel=Num(4, "[1, inf)"),
        ),
        rope_fraction=Num(1.0, "(0, 1]"),
        attention_gate=False,
        centred_norms=False,  # the norms scale by 1 + a weight that starts at 0 (Qwen3.5's form), not by the weight
        remat="none",  # one of REMAT_POLICIES
        scan_layers=True,
        attention="xla",  # one of ATTENTION_IMPLS
        context_attention="ring",  # with mesh.context > 1: one of CONTEXT_ATTENTION (trainer/model/context.py)
        init_std=Num(0.02, "(0, inf)"),
        mup_base_width=Num(0, "[0, inf)"),  # > 0: muP, with hyperparameters tuned at this d_model
        loss_chunk=Num(
            0, "[0, inf)"
        ),  # > 0: the loss makes logits this many positions at a time (less memory, one more matmul)
        # Mixture of experts (trainer/model/moe.py): num_experts 0 keeps every layer's MLP dense.
        moe=dict(
            num_experts=Num(0, "[0, inf)"),
            experts_per_token=Num(2, "[1, inf)"),  # top-k
            shared_experts=Num(0, "[0, inf)"),  # always-on experts (one MLP this many times moe.d_ff wide)
            shared_gate=False,  # the shared experts' output times sigmoid(x . w), a gate per token (Qwen3.5-MoE)
            d_ff=Num(0, "[0, inf)"),  # each expert's MLP width; 0 = model.d_ff
            dense_layers=Num(0, "[0, inf)"),  # the first layers keep a dense MLP ...
            every=Num(1, "[1, inf)"),  # ... and of the rest every this-many-th is MoE (1 = all of them)
            impl="dropless",  # one of MOE_IMPLS: grouped matmuls over sorted tokens, or fixed expert buffers
            capacity_factor=Num(1.25, "(0, inf)"),  # impl=capacity: each expert's buffer over an even share
            grouped_matmul="auto",  # impl=dropless: one of GROUPED_MATMULS (auto: megablox on TPU)
            aux_loss=Num(0.01, "[0, inf)"),  # weight of the load-balancing loss (Switch Transformer's form)
            z_loss=Num(0.001, "[0, inf)"),  # weight of the router's log(Z)^2
            router_bias=Num(0.0, "[0, inf)"),  # > 0: DeepSeek-V3's loss-free balancing, the bias's step per update
            # The router's scores: softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3: each on its own, the chosen
            # normalised, times routed_scale; experts picked within the `groups_per_token` best of `groups` groups).
            router=ROUTERS[0],  # one of ROUTERS
            routed_scale=Num(1.0, "(0, inf)"),
            groups=Num(1, "[1, inf)"),
            groups_per_token=Num(1, "[1, inf)"),
        ),
        # Multi-head latent attention (DeepSeek-V2/V3; trainer/model/latent.py), on with kv_rank > 0: keys and
        # values from a kv_rank-wide latent (what decoding caches) and queries from a q_rank-wide one (0: a
        # full projection), each head's query and key nope_dim wide plus a rope_dim RoPE part (the key's shared
        # by all heads), values v_dim wide. n_kv_heads and head_dim are then not read.
        # Multi-token prediction (DeepSeek-V3's form; trainer/model/mtp.py): `depth` extra modules in sequence,
        # module k predicting the token k + 1 after the next from the one before's hidden states and the
        # embedding of the token k ahead, through the shared embedding and head. Their cross-entropy enters
        # the loss times weight / depth; decoding and export leave the modules out.
        mtp=dict(depth=Num(0, "[0, inf)"), weight=Num(0.3, "[0, inf)")),
        mla=dict(
            kv_rank=Num(0, "[0, inf)"),
            q_rank=Num(0, "[0, inf)"),
            nope_dim=Num(128, "[1, inf)"),
            rope_dim=Num(64, "[2, inf)"),
            v_dim=Num(128, "[1, inf)"),
        ),
        # Low-rank adapters (LoRA; trainer/model/spec.py Adapters): rank > 0 trains them alone, scaled by alpha /
        # rank, beside the frozen weights of checkpoint.init_from. base: "" (as trained), int8 or nf4 (QLoRA: the
        # base's projections stored quantised; trainer/model/quantised.py). dropout: of the adapters' inputs.
        lora=dict(
            rank=Num(0, "[0, inf)"),
            alpha=Num(16.0, "(0, inf)"),
            targets=ADAPTER_TARGETS,
            dropout=Num(0.0, "[0, 1)"),
            base="",
        ),
        # Quantised training (trainer/model/low_precision.py): matmul "" (off), int8 or fp8, forward and
        # backward, for the matmuls of `targets` (of QUANT_TARGETS); the logits stay in the compute dtype
        # unless named. Master weights, optimiser state and checkpoints are unchanged.
        quant=dict(
            matmul="",
            targets=("attention", "mlp", "experts"),
        ),  # fmt: skip
    )
    # Each size is a device count (within a slice) or -1 for "the rest". `rules`
    # places each logical axis on mesh axes (a tuple; () replicates), e.g.
    # --config.mesh.rules.embed=tensor or --config.mesh.rules.vocab=.
    c.mesh = dict(
        stage=Num(1, "[1, inf)"),  # pipeline stages: the stacked layers split into this many blocks (GPipe)
        data=Num(1, "-1 or [1, inf)"),
        fsdp=Num(-1, "-1 or [1, inf)"),
        # Context parallelism: each sequence split over this many devices (attention: model.context_attention)
        context=Num(1, "-1 or [1, inf)"),
        expert=Num(1, "-1 or [1, inf)"),  # expert parallelism: model.moe's experts split over this many devices
        tensor=Num(1, "-1 or [1, inf)"),
        dcn_data=Num(1, "[1, inf)"),  # slices (TPU slices or hosts) the data axis spans; sizes above are per slice
        dcn_fsdp=Num(1, "[1, inf)"),
        dcn_context=Num(1, "[1, inf)"),
        sequence_parallel=False,  # shard the residual stream's sequence axis over tensor between blocks
        rules=dict(DEFAULT_RULES),
    )
    c.data = dict(
        source="text_files",  # one of SOURCES
        name="python_stdlib",  # TFDS dataset name (text_files: the corpus name)
        # text_files: comma-separated globs ("" = this Python's standard library); megatron: the datasets'
        # prefixes (without .bin/.idx); dolma: globs of the .npy token files
        paths="",
        data_dir="",  # where prepared datasets live; "" = ~/tensorflow_datasets
        text_key="text",  # the text's feature (tfds), field (JSON lines) or column (Parquet)
        train_split="train",
        eval_split="validation",
        tokenizer="byte",  # one of TOKENIZERS
        tokenizer_path="",  # sentencepiece: a .model file (scripts/train_tokenizer.py); hf: a tokenizer.json or its dir
        seq_len=Num(256, "[1, inf)"),
        packing="concat",  # documents concatenated and split into seq_len windows
        mixture=(),  # ("corpus:weight", ...): train on these prepared corpora of `source`, drawn by weight
        mixture_unit="tokens",  # one of MIXTURE_UNITS: what a mixture's weights are shares of
        validation_fraction=Num(
            0.02, "(0, 0.5]"
        ),  # text_files: the share of documents held out (by a hash of each one's place)
        tokenized=False,  # text_files: read the corpus's tokenised cache (made once), no tokenizer in the loop
        token_dtype="uint16",  # dolma: the token files' one of TOKEN_DTYPES
        eos_id=Num(-1, "-1 or [0, inf)"),  # dolma: the id that ends each document; -1 = the tokenizer's EOS
        workers=Num(
            0, "[0, inf)"
        ),  # processes that read and tokenise the batch rows; 0 = a thread of the training process
        # The document streams the training batches are read through (0 = train.global_batch_size). A resume that
        # changes the global batch keeps the run's own and sets this to it (trainer/training/batch_ramp.py).
        stream_rows=Num(0, "[0, inf)"),
        # Post-training (trainer/data/chat.py): one of FORMATS. `chat` rows hold `messages` (or a prompt and a
        # completion) and train on the tokens `loss_on` picks (one of LOSS_ON); `preference` rows hold a prompt
        # and the chosen and rejected replies, and train by DPO (the `dpo` section).
        format="text",
        loss_on="assistant",
        chat_template="",  # a .jinja file; "" = the hf tokenizer's own, or the built-in one for ours
    )
    c.optim = dict(
        name="adamw",  # one of OPTIMIZERS; muon uses AdamW for embeddings, norms and the head
        lr=Num(3e-4, "(0, inf)"),
        schedule="cosine",  # one of SCHEDULES
        warmup_steps=Num(100, "[0, inf)"),
        decay_steps=Num(0, "[0, inf)"),  # cosine/linear: steps of decay after warmup; 0 = to the end of training
        decay_fraction=Num(0.2, "(0, 1]"),  # wsd: the last fraction of training spent decaying
        decay_shape="linear",  # wsd: linear or cosine decay
        min_lr_ratio=Num(0.1, "[0, 1]"),
        b1=Num(0.9, "[0, 1)"),
        b2=Num(0.95, "[0, 1)"),
        eps=Num(1e-8, "(0, inf)"),  # 0 divides 0 by 0 wherever a gradient is exactly zero: NaN weights
        weight_decay=Num(0.1, "[0, inf)"),
        clip_norm=Num(1.0, "[0, inf)"),  # 0 disables clipping
        momentum=Num(0.9, "[0, 1)"),  # sgd
        z_loss=Num(0.0, "[0, inf)"),  # weight of log(Z)^2, which keeps the logits' normaliser near 1
        # An exponential moving average of the weights, kept in the optimiser state (trainer/optim/averaging.py):
        # a decay per update, or a half-life in tokens trained on (0 = none; set one of the two).
        ema_decay=Num(0.0, "[0, 1)"),
        ema_half_life_tokens=Num(0, "[0, inf)"),
    )
    # Direct preference optimisation (data.format=preference), against the frozen checkpoint.init_from weights.
    c.dpo = dict(
        beta=Num(0.1, "(0, inf)"),  # the strength of the pull back to the reference
        loss="sigmoid",  # one of DPO_LOSSES: DPO's -log sigmoid, or IPO's squared distance to 1/(2 beta)
        label_smoothing=Num(0.0, "[0, 0.5)"),  # sigmoid: the share of pairs taken to be labelled the wrong way
    )
    # Reinforcement learning on checkable rewards (data.format=prompts): GRPO, its completions sampled by our own
    # sampler from the policy being trained (trainer/training/rollouts.py; trainer/objectives/grpo.py, rewards.py).
    # train.global_batch_size counts completions: group_size of each of global_batch_size / group_size prompts.
    c.rl = dict(
        reward="exact",  # a comma list: exact, format, or module:function called f(prompt, completion, answer)
        reward_weights="",  # a comma list of floats, one per reward ("" = all 1); the rewards add
        format_regex="",  # the `format` reward: 1 where the completion matches it (re.search), else 0
        group_size=Num(4, "[1, inf)"),  # completions sampled per prompt; their rewards are compared
        max_new_tokens=Num(32, "[1, inf)"),
        temperature=Num(1.0, "(0, inf)"),
        top_p=Num(1.0, "(0, 1]"),
        epsilon=Num(0.2, "(0, 1)"),  # the policy ratio is clipped to [1 - epsilon, 1 + epsilon]
        updates_per_batch=Num(1, "[1, inf)"),  # policy steps on each batch of completions (TRL's num_iterations)
        beta=Num(0.0, "[0, inf)"),  # the KL penalty to checkpoint.init_from's weights (k3); 0 holds no reference
        loss="grpo",  # one of RL_LOSSES
    )
    # Knowledge distillation (trainer/objectives/distill.py): the student learns from a teacher's next-token
    # distributions beside the data. teacher: a run's workdir or convert_hf.py import's output, DIR[@STEP]
    # ("" = no distillation); the objective is (1 - alpha) x the data's cross-entropy + alpha x the divergence.
    c.distill = dict(
        teacher="",
        mode="online",  # one of DISTILL_MODES: the teacher in the step, or its top_k logits stored beforehand
        # Divides both models' logits in the divergence (Hinton's KD; TRL's DistillationTrainer). TRL's GKD
        # computes its divergence at 1 whatever its temperature, which samples: sample_temperature below.
        divergence_temperature=Num(1.0, "(0, inf)"),
        sample_temperature=Num(1.0, "(0, inf)"),  # on_policy's sampler (GKDConfig.temperature, 0.9 there)
        alpha=Num(0.5, "[0, 1]"),  # the divergence's weight against the data's cross-entropy
        # 0: forward KL(teacher | student), 1: reverse KL, between: GKD's generalized JSD. 0 by default: it taught
        # the quick start's student most of the three, and 1 left it worse than training alone
        # (docs/post_training.md, "Choosing beta").
        beta=Num(0.0, "[0, 1]"),
        top_k=Num(64, "[1, inf)"),  # offline: the teacher logits stored per token (scripts/teacher_logits.py)
        logits_dir="",  # offline: where scripts/teacher_logits.py wrote them; "" = beside the prepared corpus
        on_policy=Num(0.0, "[0, 1]"),  # the share of batches made of the student's own samples (GKD's lmbda)
    )
    c.precision = dict(
        param_dtype="float32",
        compute_dtype="bfloat16",
        loss_scaling="auto",  # dynamic for float16 compute, none otherwise
        initial_loss_scale=Num(2.0**15, "(0, inf)"),
        loss_scale_growth_interval=Num(2000, "[1, inf)"),  # good steps before the scale doubles
        moments_dtype="float32",  # optimiser moments; bfloat16 halves their memory
    )
    c.train = dict(
        steps=Num(1000, "[1, inf)"),
        global_batch_size=Num(32, "[1, inf)"),  # sequences per optimiser update, over all devices and microbatches
        grad_accum_steps=Num(1, "[1, inf)"),
        pipeline_microbatches=Num(
            1, "[1, inf)"
        ),  # a pipeline cuts each microbatch into these; >= mesh.stage when pipelining
        seed=Num(0, "[0, 2147483647]"),
        log_every=Num(10, "[1, inf)"),
        eval_every=Num(200, "[0, inf)"),  # 0 disables validation
        eval_batches=Num(4, "[1, inf)"),
        ramp_batch_size=Num(0, "[0, inf)"),  # > 0: start at this global batch and grow to global_batch_size ...
        ramp_tokens=Num(0, "[0, inf)"),  # ... over this many tokens (the schedule counts tokens either way)
        layer_grad_norms=False,  # also log each layer's gradient norm
        profile_steps=(),  # (first, last): a jax.profiler trace of those steps in <workdir>/profile
        trackers=("tensorboard",),  # of TRACKERS, besides metrics.jsonl (always written)
        wandb_project="trainer",  # the W&B project a `wandb` tracker logs to (entity, mode: WANDB_* variables)
        sample_prompts=(),  # at each evaluation (none without one), complete these greedily and sampled
        sample_tokens=Num(64, "[1, inf)"),  # tokens generated per sample
        # lm-evaluation-harness tasks (the `eval` extra) scored on the run's mesh every `harness_every` steps
        # (0: at each validation, train.eval_every) and at the end; metrics harness/<task>/<metric>.
        harness_tasks=(),
        harness_every=Num(0, "[0, inf)"),
        harness_limit=Num(0.0, "[0, inf)"),  # documents per task (below 1: that share of them); 0 = all
        harness_fewshot=Num(-1, "[-1, inf)"),  # examples in each prompt; -1 = each task's own
        harness_include_path="",  # a folder of task YAML files of your own (tasks over local data)
        # No step, evaluation batch or checkpoint for this long: write every thread's stack and end the run
        # (all its processes), so that the scheduler relaunches it (trainer/run/hang.py); 0 = never.
        hang_seconds=Num(1800.0, "[0, inf)"),
        sdc_check_every=Num(0, "[0, inf)"),  # on a TPU, these steps under libtpu's checker (training/sdc.py); 0: none
        # Compiled programs kept for the next launch (trainer/storage/compile_cache.py): a directory, local or gs://; a
        # relative one is taken from the workdir; "" = none. The default, beside the workdir, gives way to a
        # JAX_COMPILATION_CACHE_DIR in the environment.
        compile_cache="../compile_cache",
    )
    # Bad steps (non-finite, or a gradient-norm spike) are skipped; too many in a
    # window, or a loss that stays diverged, rolls back to the last healthy checkpoint.
    c.stability = dict(
        spike_factor=Num(10.0, "0 or (1, inf)"),  # a gradient norm above this x its running mean is a spike (0 = off)
        # steps of statistics before spikes are judged (0 would judge the first against means of 0: all spikes)
        stats_warmup=Num(20, "[1, inf)"),
        max_bad_steps=Num(4, "[0, inf)"),  # bad steps within `bad_window` that trigger a rollback (0 = off)
        bad_window=Num(50, "[1, inf)"),
        diverge_factor=Num(2.0, "(1, inf)"),  # loss above this x its running mean ...
        diverge_steps=Num(20, "[0, inf)"),  # ... for this many steps in a row triggers a rollback (0 = off)
        rollback_lr_factor=Num(0.5, "(0, 1]"),  # learning rate multiplied by this at each rollback
        max_rollbacks=Num(3, "[0, inf)"),
        # A bad step (non-finite or spiking) is computed again in the same step, to tell a transient fault (another
        # result: the hardware) from a persistent one (the same: the data, or a chip always wrong); each is counted
        # in the skipped steps' events. It doubles the step's program, not its time.
        rerun_bad_steps=False,
    )
    c.debug = dict(
        poison_batches=(),  # these data batches yield a non-finite loss and gradients (a drill)
        flip_batches=(),  # in these data batches one bit of one gradient flips, once (a drill for rerun_bad_steps)
        lr_spike=(),  # (first, last, factor): data batches first..last train at factor x the learning rate
    )
    # Keep the newest `keep`, plus every multiple of `keep_every` (0 = none).
    # `async` is a Python keyword: read it as cfg.checkpoint["async"].
    c.checkpoint = {
        "every_steps": Num(500, "[1, inf)"),
        "keep": Num(3, "[1, inf)"),
        "keep_every": Num(0, "[0, inf)"),
        # Evaluation, generation and export read the mean of the weights of the newest N checkpoints at or
        # before the step they read (0 or 1: that checkpoint's alone): a cheap average of the end of a run.
        "average_last": Num(0, "[0, inf)"),
        # ... or the run's moving average of the weights (optim.ema_decay or optim.ema_half_life_tokens).
        "read_ema": False,
        "async": True,
        # A restore (or a bucket at start-up) whose storage answers 429/5xx or times out is retried this long.
        "retry_seconds": Num(300, "[0, inf)"),
        # A label ("" = none) asking to resume this run's weights, step, schedule and data with a fresh optimiser
        # state (e.g. another optim.name). Each new label resets once ("true" for a first, e.g. a date for each
        # later one); the same label again, as a relaunch has it, resumes the state it reset to.
        "reset_optimizer": "",
        # "DIR[@STEP]": start a new run from another run's weights, everything else fresh (fine-tuning).
        "init_from": "",
        # A fast tier on each host's own disk or RAM disk ("" = none; $VARS and ~ expanded, e.g.
        # /tmp/local/$TRAINER_PROCESS_ID for processes sharing a machine): a checkpoint every local_every_steps,
        # the newest local_keep kept; a relaunch resumes from it when it is newer (trainer/storage/local_tier.py).
        "local_dir": "",
        "local_every_steps": Num(100, "[1, inf)"),
        "local_keep": Num(2, "[1, 16]"),
    }
    return vars(c)


def defaults() -> ml_collections.ConfigDict:
    """The single home of every key and its default value."""

    def values(keys: dict) -> dict:
        return {k: values(v) if _nested(v) else v.default if isinstance(v, Num) else v for k, v in keys.items()}

    c = ml_collections.ConfigDict({name: values(keys) for name, keys in _declared().items()})
    c.lock()
    return c


def _nested(value) -> bool:
    """A group of keys under one name (model.rope_scaling.*), as opposed to a dict-valued key (mesh.rules)."""
    return isinstance(value, dict) and any(isinstance(v, Num) for v in value.values())


def _ranges(keys: dict, prefix: str) -> dict[str, str]:
    out = {}
    for k, v in keys.items():
        if _nested(v):
            out.update(_ranges(v, f"{prefix}{k}."))
        elif isinstance(v, Num):
            out[f"{prefix}{k}"] = v.range
    return out


# {"section.key": range} for every numeric key (a test checks that none lacks one).
RANGES = {key: r for name, keys in _declared().items() for key, r in _ranges(keys, f"{name}.").items()}


# Keys that were renamed: refused with their new names, and read from an older run's config.json (a key that
# did two things, into both).
RENAMED = {"train.microbatches": ("train.pipeline_microbatches",),
           "distill.temperature": ("distill.divergence_temperature", "distill.sample_temperature")}  # fmt: skip


def renamed_words(key: str, flag: bool = False) -> str:
    """'is now X' or 'is now X and Y', as flags (--config.X) or as keys."""
    return "is now " + " and ".join(f"--config.{k}" if flag else k for k in RENAMED[key])


# Keys added with a default that differs from what runs did before them: an older run's config.json, which
# lacks the key, is read with the value that run had in effect.
BEFORE = {"data.mixture_unit": "documents"}


def stream_rows(cfg) -> int:
    """The training data's document streams: what train.steps and the schedule count batches of."""
    return cfg.data.stream_rows or cfg.train.global_batch_size


def microbatch_size(cfg) -> int:
    """Sequences in one microbatch: what a step computes at once (train.grad_accum_steps of them make a batch)."""
    return cfg.train.global_batch_size // cfg.train.grad_accum_steps
