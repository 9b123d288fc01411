"""What every Hugging Face family shares: the config keys they all have, the reading of those keys, and the
walk that maps our weights onto a family's tensor names and back. A family (one module beside this one)
gives what differs in a `Layout` and three functions (trainer/interop/families/__init__.py).

Our weights map one to one onto theirs: kernels are stored (in, out) here and (out, in) there, heads are
folded into the projection width, and RoPE already uses Hugging Face's half-split layout, so nothing is
permuted (DeepSeek's interleaved rows are its own module's business). An MoE layer's router is their
`gate`; the experts' names are the family's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from trainer.config.errors import ConfigError
from trainer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID
from trainer.model.spec import Architecture

# Our norm (in a block's params) under the families' names for it
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def attention_to_hf(a: dict, n: int, prefix: str, spec: Architecture) -> dict:
    """Layer `n` of a stack's query, key, value and output projections under the families' names."""
    d = spec.d_model
    return {prefix + "self_attn.q_proj.weight": a["wq"][n].reshape(d, -1).T,
            prefix + "self_attn.k_proj.weight": a["wk"][n].reshape(d, -1).T,
            prefix + "self_attn.v_proj.weight": a["wv"][n].reshape(d, -1).T,
            prefix + "self_attn.o_proj.weight": a["wo"][n].reshape(-1, d).T}  # fmt: skip


def attention_from_hf(t: dict, numbers: list[int], spec: Architecture, interleaved: bool) -> dict:
    d, n, k, h = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim

    def each(name, fn):
        return np.stack([fn(t[f"model.layers.{i}.self_attn.{name}"]) for i in numbers])

    return {"wq": each("q_proj.weight", lambda w: w.T.reshape(d, n, h)),
            "wk": each("k_proj.weight", lambda w: w.T.reshape(d, k, h)),
            "wv": each("v_proj.weight", lambda w: w.T.reshape(d, k, h)),
            "wo": each("o_proj.weight", lambda w: w.T.reshape(n, h, d))}  # fmt: skip


def expert_names(i: int, j: int) -> tuple[str, str, str]:
    """Layer i's expert j: the files' names of its gate, up and down projections (Qwen3-MoE's and
    DeepSeek-V3's; Mixtral has its own)."""
    return tuple(f"model.layers.{i}.mlp.experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down"))


def router_name(i: int) -> str:
    return f"model.layers.{i}.mlp.gate.weight"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a family names and shapes what the walk below moves; the defaults are Llama's."""

    norms: dict = dataclasses.field(default_factory=lambda: NORMS)
    norm_offset: float = 0.0  # Gemma's norms scale by 1 + weight where ours scale by the weight
    attention_to_hf: Callable = attention_to_hf
    attention_from_hf: Callable = attention_from_hf
    expert_names: Callable = expert_names
    router_name: Callable = router_name
    moe_extras_to_hf: Callable | None = None  # a router bias and shared experts (DeepSeek-V3's)
    moe_extras_from_hf: Callable | None = None
    linear_to_hf: Callable | None = None  # a hybrid's linear-attention layers (Qwen3.5's), as attention_*_hf
    linear_from_hf: Callable | None = None


def plain(spec: Architecture) -> bool:
    """No detail that only Gemma 3 has among the families (local and global layers, a local RoPE base, a
    query scale of its own; a window beside query/key norms or experts)."""
    return not any(unplain(spec).values())


def unplain(spec: Architecture) -> dict:
    return {"local_rope_theta": spec.local_rope_theta and spec.local_rope_theta != spec.rope_theta,
            "attn_scale_dim": spec.attn_scale_dim and spec.attn_scale_dim != spec.head_dim,
            "global_every": spec.sliding_window and spec.global_every,
            "sliding_window": spec.sliding_window and (spec.qk_norm or spec.moe.num_experts)}  # fmt: skip


def refuse_unclaimed(spec: Architecture) -> None:
    """A model no family claims: one sentence saying which of its details no family has."""
    bad = ", ".join(f"model.{k}={getattr(spec, k)}" for k, v in unplain(spec).items() if v)
    raise ConfigError(f"{bad or 'this model'}: of the Hugging Face families here only Gemma 3 has local and global "
                      "layers (Mistral a window on every layer, without query/key norms); this model has no Hugging "
                      "Face form.")  # fmt: skip


def common_config(spec: Architecture, max_seq_len: int, kind: str, name: str,
                  special: tuple[int, int, int] = (BOS_ID, EOS_ID, PAD_ID)) -> dict:  # fmt: skip
    """The config keys the families share, for family `kind` (model_type) of class `name`; `special`: the
    tokenizer's (begin, end, padding) ids."""
    rope = rope_parameters(spec)
    scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "architectures": [name],
        "model_type": kind,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.d_ff,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,  # transformers 4.x
        "rope_scaling": scaling,  # 4.x
        "rope_parameters": rope,  # 5.x; rope_theta and rope_scaling beside it for 4.x
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special[0],
        "eos_token_id": special[1],
        "pad_token_id": special[2],
        "dtype": "float32",
        "torch_dtype": "float32",
    }


# The common keys that a strict config class (Gemma 3's, Qwen3.5's: they refuse any other key) takes.
STRICT_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
               "torch_dtype")  # fmt: skip


def strict_common(spec: Architecture, common: dict, name: str, extra: tuple[str, ...] = ()) -> dict:
    """The common keys a strict config class takes (STRICT_KEYS and `extra`), once RoPE scaling, which those
    forms lack, is refused."""
    if spec.rope_scaling.factor != 1:
        raise ConfigError(f"model.rope_scaling: {name}'s form here has no RoPE scaling; use factor=1.")
    return {k: common[k] for k in STRICT_KEYS + extra}


def rope_parameters(spec: Architecture) -> dict:
    """transformers' rope_parameters for our RoPE: plain, Llama 3's scaling or YaRN's."""
    r = spec.rope_scaling
    plain = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if r.factor == 1:
        return plain
    if r.kind == "llama3":
        return {**plain, "rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_len}  # fmt: skip
    return {**plain, "rope_type": "yarn", "factor": r.factor, "original_max_position_embeddings": r.original_max_len,
            "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "truncate": r.truncate,
            **({"mscale": r.mscale} if r.mscale else {}),
            **({"mscale_all_dim": r.mscale_all_dim} if r.mscale_all_dim else {})}  # fmt: skip


def yarn_keys(rope: dict, config: dict) -> dict:
    """Our model.rope_scaling.* for a config's YaRN parameters (transformers' _compute_yarn_parameters: a factor
    left out is max_position_embeddings over the original length; beta_fast 32 and beta_slow 1 by default)."""
    original = int(rope["original_max_position_embeddings"])
    return {"rope_scaling.kind": "yarn",
            "rope_scaling.factor": float(rope.get("factor") or config["max_position_embeddings"] / original),
            "rope_scaling.original_max_len": original, "rope_scaling.beta_fast": float(rope.get("beta_fast") or 32),
            "rope_scaling.beta_slow": float(rope.get("beta_slow") or 1),
            "rope_scaling.mscale": float(rope.get("mscale") or 0),
            "rope_scaling.mscale_all_dim": float(rope.get("mscale_all_dim") or 0),
            "rope_scaling.truncate": bool(rope.get("truncate", True))}  # fmt: skip


def rope_of(config: dict) -> dict:
    """A config's RoPE settings: transformers 5.x writes rope_parameters, 4.x rope_scaling (None or a dict)
    beside rope_theta."""
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def refuse(config: dict, unsupported: dict) -> None:
    """One sentence naming every key of a config whose value our models do not implement."""
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise ConfigError(f"this Hugging Face model has {bad}, which this trainer's models do not implement.")


def model_keys(config: dict, rope: dict, unsupported: dict) -> dict:
    """Our model.* values the families share, after refusing `unsupported` and what none of them has."""
    refuse(config, {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "final_logit_softcapping": config.get("final_logit_softcapping") is not None,
        "attn_logit_softcapping": config.get("attn_logit_softcapping") is not None,
        "use_bidirectional_attention": bool(config.get("use_bidirectional_attention")),
        "attention_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "rope_scaling": rope_type(rope) not in ("default", "llama3", "yarn") or rope.get("attention_factor"),
        **unsupported,
    })  # fmt: skip
    heads = config["num_attention_heads"]
    scaling = yarn_keys(rope, config) if rope_type(rope) == "yarn" else {}
    if rope_type(rope) == "llama3":
        scaling = {"rope_scaling.factor": float(rope["factor"]),
                   "rope_scaling.low_freq_factor": float(rope["low_freq_factor"]),
                   "rope_scaling.high_freq_factor": float(rope["high_freq_factor"]),
                   "rope_scaling.original_max_len": int(rope["original_max_position_embeddings"])}  # fmt: skip
    return {
        **scaling,
        "moe.num_experts": 0,
        "sliding_window": 0,
        "global_every": 0,
        "vocab_size": config["vocab_size"],
        "d_model": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "d_ff": config["intermediate_size"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10_000.0))),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "qk_norm": False,
        "centred_norms": False,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def refuse_other_routers(spec: Architecture, name: str) -> None:
    """Mixtral's and Qwen3-MoE's experts: a softmax router and no shared experts (DeepSeek-V3 has both)."""
    m = spec.moe
    if m.router != "softmax":
        raise ConfigError(f"model.moe.router={m.router}: {name} routes by softmax, so this model has no Hugging "
                          "Face form.")  # fmt: skip
    if m.shared_experts:
        raise ConfigError(f"model.moe.shared_experts={m.shared_experts}: {name} has no shared experts, so this "
                          "model has no Hugging Face form here.")  # fmt: skip


def expert_keys(config: dict, count: int, width: int, dense: int, every: int) -> dict:
    """Our model.moe.* values for a mixture of softmax-routed experts (Mixtral's, Qwen3-MoE's)."""
    return {"moe.num_experts": count, "moe.d_ff": width, "moe.dense_layers": dense, "moe.every": every,
            "moe.experts_per_token": config["num_experts_per_tok"], "moe.shared_experts": 0}  # fmt: skip


def norm_offset(spec: Architecture, layout: Layout) -> float:
    """What a norm weight of ours less that of the family's is: their gain's offset (1 where they scale by
    1 + weight) less ours (1 under model.centred_norms); 0 goes across unchanged."""
    return layout.norm_offset - (1.0 if spec.centred_norms else 0.0)


def layers_by_stack(spec: Architecture) -> dict[str, list[int]]:
    """Our stacks of layers and the layer numbers each holds, in order."""
    stacks = {}
    for i, (stack, _) in enumerate(spec.stacks()):
        stacks.setdefault(stack, []).append(i)
    return stacks


def to_hf_tensors(params: dict, spec: Architecture, layout: Layout, name: str) -> dict[str, np.ndarray]:
    """Our parameters as the tensors of family class `name` laid out by `layout`."""
    off = norm_offset(spec, layout)
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"] - off}
    if not spec.tie_embeddings:
        # muP divides our logits by m; the families have no output multiplier, so the head carries it
        # (muP refuses tied embeddings, so the input table is untouched).
        out["lm_head.weight"] = params["lm_head"].T / spec.width_multiplier
    for stack, numbers in layers_by_stack(spec).items():
        layers = params[stack]
        for n, i in enumerate(numbers):
            a, prefix = layers["attn"], f"model.layers.{i}."
            if stack == "linear_layers":
                out.update(layout.linear_to_hf(a, n, prefix, spec))
            else:
                out.update(layout.attention_to_hf(a, n, prefix, spec))
            if spec.qk_norm and stack != "linear_layers":
                out[prefix + "self_attn.q_norm.weight"] = a["q_norm"]["scale"][n] - off
                out[prefix + "self_attn.k_norm.weight"] = a["k_norm"]["scale"][n] - off
            if "moe" in layers:
                m = layers["moe"]
                if layout.moe_extras_to_hf is not None:
                    out.update(layout.moe_extras_to_hf(m, n, prefix))
                elif np.any(m["router_bias"][n] != 0):
                    raise ConfigError(f"layer {i}'s router bias (model.moe.router_bias) is not zero: {name} has no "
                                      "place for it.")  # fmt: skip
                out[layout.router_name(i)] = m["router"][n].T
                for j in range(spec.moe.num_experts):
                    for theirs, w in zip(layout.expert_names(i, j), ("w_gate", "w_up", "w_down"), strict=True):
                        out[theirs] = m[w][n, j].T
            else:
                for w, theirs in MLP:
                    out[prefix + f"mlp.{theirs}.weight"] = layers["mlp"][w][n].T
            for theirs, ours in layout.norms.items():
                out[prefix + f"{theirs}.weight"] = layers[ours]["scale"][n] - off
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf_tensors(t: dict[str, np.ndarray], spec: Architecture, layout: Layout, interleaved: bool) -> dict:
    """Our parameters from a family's tensors laid out by `layout` (`interleaved`: DeepSeek's RoPE rows)."""
    off = norm_offset(spec, layout)
    params = {"embed": t["model.embed_tokens.weight"], "final_norm": {"scale": t["model.norm.weight"] + off}}
    for stack, numbers in layers_by_stack(spec).items():

        def each(name, fn, numbers=numbers):
            return np.stack([fn(t[f"model.layers.{i}.{name}"]) for i in numbers])

        if stack == "linear_layers":
            attn = layout.linear_from_hf(t, numbers, spec)
        else:
            attn = layout.attention_from_hf(t, numbers, spec, interleaved)
        if spec.qk_norm and stack != "linear_layers":
            attn.update({f"{q}_norm": {"scale": each(f"self_attn.{q}_norm.weight", lambda w: w + off)} for q in "qk"})
        layers = {"attn": attn, **{ours: {"scale": each(f"{theirs}.weight", lambda w: w + off)}
                                   for theirs, ours in layout.norms.items()}}  # fmt: skip
        if spec.moe_stack(stack):
            experts = range(spec.moe.num_experts)
            names = {i: [layout.expert_names(i, j) for j in experts] for i in numbers}
            layers["moe"] = {
                "router": np.stack([t[layout.router_name(i)].T for i in numbers]),
                "router_bias": np.zeros((len(numbers), spec.moe.num_experts), np.float32),
                **{w: np.stack([np.stack([t[names[i][j][c]].T for j in experts]) for i in numbers])
                   for c, w in enumerate(("w_gate", "w_up", "w_down"))},
            }  # fmt: skip
            if layout.moe_extras_from_hf is not None:
                layers["moe"].update(layout.moe_extras_from_hf(t, numbers))
        else:
            layers["mlp"] = {w: each(f"mlp.{theirs}.weight", lambda x: x.T) for w, theirs in MLP}
        params[stack] = layers
    if not spec.tie_embeddings:
        params["lm_head"] = t["lm_head.weight"].T * spec.width_multiplier  # undo the export's muP folding
    return _as_float32(params)


def _as_float32(tree):
    if isinstance(tree, dict):
        return {k: _as_float32(v) for k, v in tree.items()}
    return np.ascontiguousarray(tree, np.float32)
