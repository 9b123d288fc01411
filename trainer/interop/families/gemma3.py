"""Gemma 3, text (`Gemma3ForCausalLM`, model_type gemma3_text): local layers over a sliding window and
global ones in any every-n-th pattern, each kind with its RoPE base; sandwich norms (four a layer), GeGLU,
query/key norms, a query scale of its own (query_pre_attn_scalar) and embeddings scaled by sqrt(width),
tied to the head. Gemma's norms scale by 1 + weight where ours scale by the weight, so its norm weights are
ours minus one.

Its config.json is published in three forms, read as transformers' Gemma3TextConfig reads each: the Hub's
own (google/gemma-3-1b-it) gives sliding_window_pattern (every n-th layer global, 6 if absent) and
rope_theta with rope_local_base_freq; a form between gives layer_types with those two thetas; today's
gives layer_types and rope_parameters per layer type.
"""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"gemma3_text": "Gemma3ForCausalLM"}
LAYOUT = core.Layout(
    norms={"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
           "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_out_norm"},
    norm_offset=1.0,
)  # fmt: skip
THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' defaults


def claims(spec: Architecture) -> str | None:
    gemma = {"post_norms": spec.post_norms, "embed_scale": spec.embed_scale,
             "mlp_activation": spec.mlp_activation == "gelu_tanh"}  # fmt: skip
    if not any(gemma.values()):
        return None
    missing = [k for k, v in {**gemma, "qk_norm": spec.qk_norm}.items() if not v]
    if missing or spec.moe.num_experts:
        why = f"lacks {', '.join(missing)}" if missing else "has experts"
        raise ConfigError(f"this model has Gemma's details but {why}: Gemma 3 is the only family here with them, "
                          "so it has no Hugging Face form.")  # fmt: skip
    return "gemma3_text"


def config(spec: Architecture, common: dict) -> dict:
    """Gemma3TextConfig's keys (it refuses others'): each layer's type, each type's RoPE base."""
    local_theta = spec.local_rope_theta or spec.rope_theta
    return {
        **core.strict_common(spec, common, "Gemma 3"),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": spec.attn_scale_dim or spec.head_dim,
        # Without a window every layer is global; the window's value is then never read.
        "sliding_window": spec.sliding_window or common["max_position_embeddings"],
        "layer_types": ["sliding_attention" if spec.is_local(i) else "full_attention" for i in range(spec.n_layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }  # fmt: skip


def as_published_now(config: dict) -> dict:
    """A config.json of any published form in today's (layer_types, rope_parameters per layer type)."""
    pattern = config.get("sliding_window_pattern", 6)
    layers = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config["num_hidden_layers"])
    ]
    given = config.get("rope_parameters") or {}
    rope = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in THETA}
    if config.get("rope_scaling"):
        rope["full_attention"].update(config["rope_scaling"])
    rope["full_attention"].setdefault("rope_theta", config.get("rope_theta", THETA["full_attention"]))
    rope["sliding_attention"].setdefault("rope_theta", config.get("rope_local_base_freq", THETA["sliding_attention"]))
    return {**config, "layer_types": layers, "rope_parameters": rope, "rope_scaling": None,
            "sliding_window": config.get("sliding_window", 4096)}  # fmt: skip


def _window(config: dict) -> tuple[int, int] | None:
    """(model.sliding_window, model.global_every) for the layers' types; None for a pattern of local and global
    layers that is not every-n-th-global."""
    window = config.get("sliding_window") or 0
    local = [t == "sliding_attention" for t in config["layer_types"]]
    if not any(local) or not window:
        return 0, 0
    every = 0 if all(local) else local.index(False) + 1
    same = all(loc == bool(not every or (i + 1) % every) for i, loc in enumerate(local))
    return (window, every) if same else None


def model_keys(config: dict) -> dict:
    config = as_published_now(config)
    full, local = config["rope_parameters"]["full_attention"], config["rope_parameters"]["sliding_attention"]
    window = _window(config)
    keys = core.model_keys(config, full, {
        "hidden_act": False,  # Gemma names its activation hidden_activation
        "hidden_activation": config.get("hidden_activation") != "gelu_pytorch_tanh",
        "layer_types": window is None,
        "rope_scaling": core.rope_type(full) != "default" or core.rope_type(local) != "default",
    })  # fmt: skip
    scale = config.get("query_pre_attn_scalar", keys["head_dim"])
    local_theta = float(local.get("rope_theta", keys["rope_theta"]))
    keys.update({"embed_scale": True, "post_norms": True, "mlp_activation": "gelu_tanh", "qk_norm": True,
                 "attn_scale_dim": 0 if scale == keys["head_dim"] else int(scale),
                 "local_rope_theta": 0.0 if local_theta == keys["rope_theta"] else local_theta,
                 "sliding_window": window[0], "global_every": window[1]})  # fmt: skip
    return keys
