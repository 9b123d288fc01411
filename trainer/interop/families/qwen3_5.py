"""Qwen3.5, text (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid of Gated DeltaNet layers
(trainer/model/delta.py; `linear_attn` in its files) and gated full attention, each layer's kind in
layer_types (by default every fourth layer full). Its full attention has query/key norms, RoPE over the first
partial_rotary_factor of each head, and an output gate that q_proj gives beside each head's query
(per head: its query, then its gate). Its norms scale by 1 + weight, as ours do under model.centred_norms
(which an import sets, so that the weights go across unchanged), except the linear layers' gated norm, which
scales by the weight.

A linear layer's q, k and v come from one projection, in_proj_qkv (q's rows, k's, then v's), and pass one
depthwise convolution over the same channels in that order; ours keeps each apart, so that the tensor axis
splits them by head.

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, qwen3_5_moe_text) is the same hybrid with a mixture in every layer:
softmax-routed experts (their top-k weights renormalised, as ours are) in Qwen3-MoE's per-expert files, and a
shared expert (shared_expert_intermediate_size wide: model.moe.shared_experts times moe.d_ff) whose output is
gated per token by sigmoid(shared_expert_gate . x) (model.moe.shared_gate).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from trainer.config.errors import ConfigError
from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
LINEAR = ("linear_attention", "full_attention")


def gated_attention_to_hf(a: dict, n: int, prefix: str, spec: Architecture) -> dict:
    """As core.attention_to_hf, with each head's gate after its query in q_proj."""
    out = core.attention_to_hf(a, n, prefix, spec)
    out[prefix + "self_attn.q_proj.weight"] = np.concatenate([a["wq"][n], a["wg"][n]], axis=2).reshape(
        spec.d_model, -1).T  # fmt: skip
    return out


def gated_attention_from_hf(t: dict, numbers: list[int], spec: Architecture, interleaved: bool) -> dict:
    d, n, k, h = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim

    def each(name, fn):
        return np.stack([fn(t[f"model.layers.{i}.self_attn.{name}"]) for i in numbers])

    both = each("q_proj.weight", lambda w: w.T.reshape(d, n, 2 * h))
    return {"wq": both[..., :h], "wg": both[..., h:],
            "wk": each("k_proj.weight", lambda w: w.T.reshape(d, k, h)),
            "wv": each("v_proj.weight", lambda w: w.T.reshape(d, k, h)),
            "wo": each("o_proj.weight", lambda w: w.T.reshape(n, h, d))}  # fmt: skip


def linear_to_hf(a: dict, n: int, prefix: str, spec: Architecture) -> dict:
    """Layer `n` of the linear stack under Qwen3.5's names."""
    d, p = spec.d_model, prefix + "linear_attn."
    flat = lambda w: w[n].reshape(d, -1).T  # noqa: E731 - (d, heads, dim) -> (heads x dim, d)
    conv = [a[f"conv_{c}"][n].reshape(spec.linear.conv_kernel, -1).T for c in "qkv"]  # (channels, K) each
    return {p + "in_proj_qkv.weight": np.concatenate([flat(a["wq"]), flat(a["wk"]), flat(a["wv"])]),
            p + "in_proj_z.weight": flat(a["wz"]), p + "in_proj_b.weight": a["wb"][n].T,
            p + "in_proj_a.weight": a["wa"][n].T, p + "conv1d.weight": np.concatenate(conv)[:, None, :],
            p + "dt_bias": a["dt_bias"][n], p + "A_log": a["a_log"][n], p + "norm.weight": a["norm"]["scale"][n],
            p + "out_proj.weight": a["wo"][n].reshape(-1, d).T}  # fmt: skip


def linear_from_hf(t: dict, numbers: list[int], spec: Architecture) -> dict:
    d, lin = spec.d_model, spec.linear
    key, value = (lin.key_heads, lin.key_dim), (lin.value_heads, lin.value_dim)
    shapes = {"q": key, "k": key, "v": value}
    bounds = np.cumsum([0, *(h * w for h, w in shapes.values())])

    def each(name, fn):
        return np.stack([fn(t[f"model.layers.{i}.linear_attn.{name}"]) for i in numbers])

    out = {}
    for j, (c, (heads, dim)) in enumerate(shapes.items()):
        rows = slice(bounds[j], bounds[j + 1])
        out[f"w{c}"] = each("in_proj_qkv.weight", lambda w, rows=rows, s=(d, heads, dim): w[rows].T.reshape(s))
        out[f"conv_{c}"] = each("conv1d.weight", lambda w, rows=rows, s=(heads, dim): w[rows, 0].T.reshape(-1, *s))
    return {**out, "wz": each("in_proj_z.weight", lambda w: w.T.reshape(d, lin.value_heads, lin.value_dim)),
            "wb": each("in_proj_b.weight", lambda w: w.T), "wa": each("in_proj_a.weight", lambda w: w.T),
            "dt_bias": each("dt_bias", lambda w: w), "a_log": each("A_log", lambda w: w),
            "norm": {"scale": each("norm.weight", lambda w: w)},
            "wo": each("out_proj.weight", lambda w: w.T.reshape(lin.value_heads, lin.value_dim, d))}  # fmt: skip


def shared_to_hf(moe: dict, n: int, prefix: str) -> dict:
    """Layer `n`'s shared expert and its gate under Qwen3.5-MoE's names."""
    out = {prefix + "mlp.shared_expert_gate.weight": moe["w_shared_gate"][n][None, :]}
    for ours, theirs in core.MLP:
        out[prefix + f"mlp.shared_expert.{theirs}.weight"] = moe["shared"][ours][n].T
    return out


def shared_from_hf(t: dict, numbers: list[int]) -> dict:
    return {"w_shared_gate": np.stack([t[f"model.layers.{i}.mlp.shared_expert_gate.weight"][0] for i in numbers]),
            "shared": {ours: np.stack([t[f"model.layers.{i}.mlp.shared_expert.{theirs}.weight"].T for i in numbers])
                       for ours, theirs in core.MLP}}  # fmt: skip


LAYOUT = core.Layout(norm_offset=1.0, attention_to_hf=gated_attention_to_hf, attention_from_hf=gated_attention_from_hf,
                     linear_to_hf=linear_to_hf, linear_from_hf=linear_from_hf, moe_extras_to_hf=shared_to_hf,
                     moe_extras_from_hf=shared_from_hf)  # fmt: skip


def claims(spec: Architecture) -> str | None:
    hybrid = {"layer_types": bool(spec.layer_types), "attention_gate": spec.attention_gate}
    if not any(hybrid.values()):
        return None
    m = spec.moe
    needs = {"qk_norm": spec.qk_norm, **({"moe.shared_experts": m.shared_experts, "moe.shared_gate": m.shared_gate}
                                         if m.num_experts else {})}  # fmt: skip
    missing = [k for k, v in {**hybrid, **needs}.items() if not v]
    if missing or not core.plain(spec):
        why = f"lacks {', '.join(missing)}" if missing else "has a window"
        raise ConfigError(f"this model has Qwen3.5's details but {why}: Qwen3.5 (and Qwen3.5-MoE, with a gated "
                          "shared expert) is the only hybrid family here, so it has no Hugging Face form.")  # fmt: skip
    return "qwen3_5_moe_text" if m.num_experts else "qwen3_5_text"


def config(spec: Architecture, common: dict) -> dict:
    """Qwen3_5TextConfig's keys (it refuses others')."""
    lin, m = spec.linear, spec.moe
    strict = core.strict_common(spec, common, "Qwen3.5", ("hidden_act",))
    experts = {}
    if m.num_experts:  # every layer a mixture: no dense width
        core.refuse_other_routers(dataclasses.replace(spec, moe=dataclasses.replace(m, shared_experts=0)),
                                  CLASSES["qwen3_5_moe_text"])  # fmt: skip
        del strict["intermediate_size"]
        experts = {"num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
                   "moe_intermediate_size": spec.expert_d_ff,
                   "shared_expert_intermediate_size": m.shared_experts * spec.expert_d_ff}  # fmt: skip
    return {**strict, **experts,
            "layer_types": list(spec.layer_types),
            "linear_conv_kernel_dim": lin.conv_kernel, "linear_key_head_dim": lin.key_dim,
            "linear_value_head_dim": lin.value_dim, "linear_num_key_heads": lin.key_heads,
            "linear_num_value_heads": lin.value_heads,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                                "partial_rotary_factor": spec.rope_fraction}}  # fmt: skip


def model_keys(config: dict) -> dict:
    moe = config.get("model_type") == "qwen3_5_moe_text"
    if moe:  # every layer a mixture; our dense width, unused, is the experts'
        config = {**config, "intermediate_size": config["moe_intermediate_size"]}
    rope = core.rope_of(config)
    layers = config["num_hidden_layers"]
    every = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or [LINEAR[0] if (i + 1) % every else LINEAR[1] for i in range(layers)]
    keys = core.model_keys(config, rope, {"layer_types": any(t not in LINEAR for t in types)})
    keys.update({"qk_norm": True, "attention_gate": True, "centred_norms": True, "layer_types": tuple(types),
                 "rope_fraction": float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
                 "linear.key_heads": config["linear_num_key_heads"],
                 "linear.value_heads": config["linear_num_value_heads"],
                 "linear.key_dim": config["linear_key_head_dim"], "linear.value_dim": config["linear_value_head_dim"],
                 "linear.conv_kernel": config["linear_conv_kernel_dim"]})  # fmt: skip
    if moe:
        width, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
        if shared % width:
            raise ConfigError(f"this Qwen3.5-MoE's shared expert is {shared} wide, not a multiple of its "
                              f"experts' {width}: model.moe.shared_experts counts experts of their width.")  # fmt: skip
        keys.update(core.expert_keys(config, config["num_experts"], width, 0, 1))
        keys.update({"moe.shared_experts": shared // width, "moe.shared_gate": True})
    return keys
