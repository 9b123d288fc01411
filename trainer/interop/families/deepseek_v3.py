"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): latent attention, the sigmoid router with its correction bias and
groups, shared experts.

Latent attention (trainer/model/latent.py) maps weight for weight: q_a_proj / q_a_layernorm / q_b_proj
(or q_proj), kv_a_proj_with_mqa (the latent's rows, then the shared RoPE key's), kv_a_layernorm,
kv_b_proj and o_proj. DeepSeek's own checkpoints rotate interleaved pairs (rope_interleave): their RoPE
rows are reordered, evens then odds, into the half-split pairs ours rotates (the scores are the same);
an export writes rope_interleave false. The router is the sigmoid one with its correction bias
(`e_score_correction_bias`, our router_bias), n_group / topk_group and routed_scaling_factor; the shared
experts one MLP. The multi-token prediction modules have no place in transformers' class (it ignores
them): an export leaves them out.
"""

from __future__ import annotations

import numpy as np

from trainer.config.errors import ConfigError
from trainer.interop.families import core
from trainer.model.spec import Architecture

KIND = "deepseek_v3"
CLASS = "DeepseekV3ForCausalLM"
CLASSES = {KIND: CLASS}


def claims(spec: Architecture) -> str | None:
    """The family of latent attention; one it cannot hold is refused."""
    if not spec.mla.kv_rank:
        return None
    m = spec.moe
    bad = {"moe.router": m.num_experts and m.router != "sigmoid", "moe.every": m.num_experts and m.every != 1,
           "moe.shared_experts": m.num_experts and not m.shared_experts,
           "rope_scaling.kind": spec.rope_scaling.factor != 1 and not spec.rope_scaling.yarn,
           "tie_embeddings": spec.tie_embeddings}  # fmt: skip
    if any(bad.values()):
        said = ", ".join(f"model.{k}" for k, v in bad.items() if v)
        raise ConfigError(f"{said}: DeepSeek-V3, the only family here with latent attention, has a sigmoid router "
                          "on every layer after its dense ones, shared experts, no RoPE scaling but YaRN's and "
                          "an untied head; this model has no Hugging Face form.")  # fmt: skip
    return KIND


def config(spec: Architecture, common: dict) -> dict:
    m, a = spec.moe, spec.mla
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "bos_token_id",
            "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "hidden_act")  # fmt: skip
    experts = m.num_experts or 1  # a dense model: every layer dense (first_k_dense_replace), its router unread
    return {
        **{k: common[k] for k in keep},
        "architectures": [CLASS],
        "model_type": KIND,
        "num_key_value_heads": spec.n_heads,
        "q_lora_rank": a.q_rank or None,
        "kv_lora_rank": a.kv_rank,
        "qk_nope_head_dim": a.nope_dim,
        "qk_rope_head_dim": a.rope_dim,
        "v_head_dim": a.v_dim,
        "rope_parameters": core.rope_parameters(spec),
        "rope_interleave": False,
        "n_routed_experts": experts,
        "num_experts_per_tok": m.experts_per_token if m.num_experts else 1,
        "n_shared_experts": m.shared_experts if m.num_experts else 1,
        "moe_intermediate_size": spec.expert_d_ff,
        "first_k_dense_replace": m.dense_layers if m.num_experts else spec.n_layers,
        "routed_scaling_factor": m.routed_scale,
        "n_group": m.groups,
        "topk_group": m.groups_per_token,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
    }


def model_keys(config: dict) -> dict:
    """Our model.* values for a DeepSeek-V3 config; refuses what our model does not implement."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "rope_parameters": kind not in ("default", "yarn") or rope.get("attention_factor") is not None,
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias")),
        "norm_topk_prob": not config.get("norm_topk_prob", True),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings")),
    }
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise ConfigError(f"this Hugging Face model has {bad}, which this trainer's models do not implement.")
    layers, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
    heads = config["num_attention_heads"]
    experts = {"moe.num_experts": 0}
    if dense < layers:
        experts = {"moe.num_experts": config["n_routed_experts"],
                   "moe.experts_per_token": config["num_experts_per_tok"],
                   "moe.shared_experts": config["n_shared_experts"], "moe.d_ff": config["moe_intermediate_size"],
                   "moe.dense_layers": dense, "moe.every": 1, "moe.router": "sigmoid",
                   "moe.routed_scale": float(config["routed_scaling_factor"]), "moe.groups": config.get("n_group", 1),
                   "moe.groups_per_token": config.get("topk_group", 1)}  # fmt: skip
    return {
        **experts,
        **(core.yarn_keys(rope, config) if kind == "yarn" else {}),
        "mla.kv_rank": config["kv_lora_rank"],
        "mla.q_rank": config.get("q_lora_rank") or 0,
        "mla.nope_dim": config["qk_nope_head_dim"],
        "mla.rope_dim": config["qk_rope_head_dim"],
        "mla.v_dim": config["v_head_dim"],
        "vocab_size": config["vocab_size"],
        "d_model": config["hidden_size"],
        "n_layers": layers,
        "n_heads": heads,
        "n_kv_heads": heads,
        "d_ff": config["intermediate_size"],
        "head_dim": config["hidden_size"] // heads,  # not read under latent attention
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "qk_norm": False,
        "tie_embeddings": False,
    }


def _halves(rope: int) -> np.ndarray:
    """The interleaved pairs' rows (0, 1), (2, 3), ... as half-split pairs: evens, then odds."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def attention_to_hf(a: dict, n: int, prefix: str, spec: Architecture) -> dict:
    """Layer `n` of a stack's attention weights `a` under DeepSeek-V3's names (prefix: model.layers.i.)."""
    d, m = spec.d_model, spec.mla
    out = {}
    if m.q_rank:
        out["self_attn.q_a_proj.weight"] = a["wq_a"][n].T
        out["self_attn.q_a_layernorm.weight"] = a["q_latent_norm"]["scale"][n]
        out["self_attn.q_b_proj.weight"] = a["wq_b"][n].reshape(m.q_rank, -1).T
    else:
        out["self_attn.q_proj.weight"] = a["wq"][n].reshape(d, -1).T
    out["self_attn.kv_a_proj_with_mqa.weight"] = np.concatenate([a["wkv_a"][n], a["wk_rope"][n]], axis=1).T
    out["self_attn.kv_a_layernorm.weight"] = a["kv_latent_norm"]["scale"][n]
    out["self_attn.kv_b_proj.weight"] = a["wkv_b"][n].reshape(m.kv_rank, -1).T
    out["self_attn.o_proj.weight"] = a["wo"][n].reshape(-1, d).T
    return {prefix + k: v for k, v in out.items()}


def attention_from_hf(t: dict, numbers: list[int], spec: Architecture, interleaved: bool) -> dict:
    """The attention weights of layers `numbers` (one stack) from DeepSeek-V3's tensors."""
    d, n, m = spec.d_model, spec.n_heads, spec.mla
    qk = m.nope_dim + m.rope_dim
    order = _halves(m.rope_dim) if interleaved else np.arange(m.rope_dim)
    head_order = np.concatenate([np.arange(m.nope_dim), m.nope_dim + order])  # within each query head

    def each(name, fn):
        return np.stack([fn(t[f"model.layers.{i}.self_attn.{name}"]) for i in numbers])

    out = {}
    if m.q_rank:
        out["wq_a"] = each("q_a_proj.weight", lambda w: w.T)
        out["q_latent_norm"] = {"scale": each("q_a_layernorm.weight", lambda w: w)}
        out["wq_b"] = each("q_b_proj.weight", lambda w: w.T.reshape(m.q_rank, n, qk)[..., head_order])
    else:
        out["wq"] = each("q_proj.weight", lambda w: w.T.reshape(d, n, qk)[..., head_order])
    out["wkv_a"] = each("kv_a_proj_with_mqa.weight", lambda w: w[: m.kv_rank].T)
    out["wk_rope"] = each("kv_a_proj_with_mqa.weight", lambda w: w[m.kv_rank :][order].T)
    out["kv_latent_norm"] = {"scale": each("kv_a_layernorm.weight", lambda w: w)}
    out["wkv_b"] = each("kv_b_proj.weight", lambda w: w.T.reshape(m.kv_rank, n, m.nope_dim + m.v_dim))
    out["wo"] = each("o_proj.weight", lambda w: w.T.reshape(n, m.v_dim, d))
    return out


def moe_extras_to_hf(moe: dict, n: int, prefix: str) -> dict:
    """Layer `n`'s router bias and shared experts under DeepSeek-V3's names."""
    out = {prefix + "mlp.gate.e_score_correction_bias": moe["router_bias"][n]}
    for ours, theirs in core.MLP:
        out[prefix + f"mlp.shared_experts.{theirs}.weight"] = moe["shared"][ours][n].T
    return out


def moe_extras_from_hf(t: dict, numbers: list[int]) -> dict:
    return {
        "router_bias": np.stack([t[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in numbers]),
        "shared": {ours: np.stack([t[f"model.layers.{i}.mlp.shared_experts.{theirs}.weight"].T for i in numbers])
                   for ours, theirs in core.MLP},
    }  # fmt: skip


LAYOUT = core.Layout(attention_to_hf=attention_to_hf, attention_from_hf=attention_from_hf,
                     moe_extras_to_hf=moe_extras_to_hf, moe_extras_from_hf=moe_extras_from_hf)  # fmt: skip
