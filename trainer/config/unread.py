"""Keys that only some settings read. One set away from its default where nothing reads it does nothing, which
a warning says at start-up (trainer/training/validation.py's unread_settings)."""

from trainer.config import RL_KEYS

# (that setting, its values that read the key)
READ_ONLY_UNDER = {
    "optim.decay_steps": ("optim.schedule", ("cosine", "linear")),
    "optim.decay_fraction": ("optim.schedule", ("wsd",)),
    "optim.decay_shape": ("optim.schedule", ("wsd",)),
    "optim.min_lr_ratio": ("optim.schedule", ("cosine", "linear", "wsd")),
    "optim.b1": ("optim.name", ("adamw", "lion", "muon")),
    "optim.b2": ("optim.name", ("adamw", "lion", "muon")),
    "optim.eps": ("optim.name", ("adamw",)),
    "optim.momentum": ("optim.name", ("sgd",)),
    # loss_scaling 'auto' is dynamic under float16 compute, none otherwise
    "precision.initial_loss_scale": ("precision.loss_scaling", ("dynamic",)),
    "precision.loss_scale_growth_interval": ("precision.loss_scaling", ("dynamic",)),
    "data.tokenizer_path": ("data.tokenizer", ("sentencepiece", "hf")),
    "data.token_dtype": ("data.source", ("dolma",)),
    "data.eos_id": ("data.source", ("dolma",)),
    "model.moe.capacity_factor": ("model.moe.impl", ("capacity",)),
    "data.loss_on": ("data.format", ("chat",)),
    "data.chat_template": ("data.format", ("chat", "preference", "prompts")),
    "dpo.beta": ("data.format", ("preference",)),
    "dpo.loss": ("data.format", ("preference",)),
    "dpo.label_smoothing": ("dpo.loss", ("sigmoid",)),
    **{f"rl.{k}": ("data.format", ("prompts",)) for k in RL_KEYS},
    "model.moe.grouped_matmul": ("model.moe.impl", ("dropless",)),
    "distill.top_k": ("distill.mode", ("offline",)),
    "distill.logits_dir": ("distill.mode", ("offline",)),
}
# Keys read only when another is not 0 (named first, and alone, when it is): the experts' own with experts.
READ_ONLY_WITH = {f"model.moe.{k}": "model.moe.num_experts"
                  for k in ("experts_per_token", "shared_experts", "d_ff", "dense_layers", "every", "impl",
                            "capacity_factor", "grouped_matmul", "aux_loss", "z_loss", "router_bias")}  # fmt: skip
READ_ONLY_WITH |= {f"checkpoint.{k}": "checkpoint.local_dir" for k in ("local_every_steps", "local_keep")}
READ_ONLY_WITH |= {f"model.{k}": "model.sliding_window" for k in ("global_every", "local_rope_theta")}
READ_ONLY_WITH |= {f"model.moe.{k}": "model.moe.num_experts" for k in ("router", "routed_scale", "groups",
                                                                      "groups_per_token")}  # fmt: skip
READ_ONLY_WITH |= {f"model.mla.{k}": "model.mla.kv_rank" for k in ("q_rank", "nope_dim", "rope_dim", "v_dim")}
READ_ONLY_WITH |= {"model.mtp.weight": "model.mtp.depth", "model.moe.shared_gate": "model.moe.num_experts"}
READ_ONLY_WITH |= {f"distill.{k}": "distill.teacher"
                   for k in ("mode", "divergence_temperature", "sample_temperature", "alpha", "beta", "top_k",
                             "logits_dir", "on_policy")}  # fmt: skip
