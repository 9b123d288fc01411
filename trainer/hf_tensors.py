"""Our model as a Hugging Face config and tensors, and back: Llama, Mistral, Qwen3, Mixtral, Qwen3-MoE,
Gemma 3 (text) and DeepSeek-V3 (what differs for it: trainer/hf_deepseek.py).

Which family a model is follows from its architecture: Gemma's details (sandwich norms, scaled
embeddings, GeGLU) make it Gemma 3's, with any pattern of local and global layers; query/key norms make
it Qwen3's, experts make it a mixture (Mixtral without query/key norms, Qwen3-MoE with them), a sliding
window on every layer Mistral's, none of these a Llama. Gemma's norms scale by 1 + weight where ours
scale by the weight, so its norm weights are ours minus one. Our weights map one
to one onto theirs: kernels are stored (in, out) here and (out, in) there, heads are folded into the
projection width, and RoPE already uses Hugging Face's half-split layout, so nothing is permuted. An MoE
layer's router is their `gate`; each expert's gate, up and down projections are Mixtral's w1, w3 and w2,
Qwen3-MoE's gate_proj, up_proj and down_proj (the per-expert files `save_pretrained` writes; transformers
fuses them on loading). Both families renormalise the top-k weights as we do (Qwen3-MoE only with
norm_topk_prob, which an import requires); Mixtral has no dense layers, and neither family has our
shared experts or DeepSeek's router bias, which an export refuses.
"""

from __future__ import annotations

import numpy as np

from trainer import hf_deepseek
from trainer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID
from trainer.errors import ConfigError
from trainer.model.spec import Architecture

FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", hf_deepseek.KIND: hf_deepseek.CLASS}  # fmt: skip
# Our norm (in a block's params) under each family's name for it
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
GEMMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_out_norm",
               "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_out_norm"}  # fmt: skip


def family(spec: Architecture) -> str:
    """The Hugging Face family of this architecture; refuses one that no family here has."""
    if spec.attention_sinks:
        raise ConfigError("model.attention_sinks: none of the Hugging Face families here (gpt-oss's is not among "
                          "them) has attention sinks, so this model has no Hugging Face form.")  # fmt: skip
    if spec.mla.kv_rank:
        hf_deepseek.check(spec)
        return hf_deepseek.KIND
    gemma = {"post_norms": spec.post_norms, "embed_scale": spec.embed_scale,
             "mlp_activation": spec.mlp_activation == "gelu_tanh"}  # fmt: skip
    if any(gemma.values()):
        missing = [k for k, v in {**gemma, "qk_norm": spec.qk_norm}.items() if not v]
        if missing or spec.moe.num_experts:
            why = f"lacks {', '.join(missing)}" if missing else "has experts"
            raise ConfigError(f"this model has Gemma's details but {why}: Gemma 3 is the only family here with "
                              "them, so it has no Hugging Face form.")  # fmt: skip
        return "gemma3_text"
    other = {"local_rope_theta": spec.local_rope_theta and spec.local_rope_theta != spec.rope_theta,
             "attn_scale_dim": spec.attn_scale_dim and spec.attn_scale_dim != spec.head_dim,
             "global_every": spec.sliding_window and spec.global_every,
             "sliding_window": spec.sliding_window and (spec.qk_norm or spec.moe.num_experts)}  # fmt: skip
    if any(other.values()):
        bad = ", ".join(f"model.{k}={getattr(spec, k)}" for k, v in other.items() if v)
        raise ConfigError(f"{bad}: of the Hugging Face families here only Gemma 3 has local and global layers "
                          "(Mistral a window on every layer, without query/key norms); this model has no Hugging "
                          "Face form.")  # fmt: skip
    if spec.sliding_window:
        return "mistral"
    if not spec.moe.num_experts:
        return "qwen3" if spec.qk_norm else "llama"
    return "qwen3_moe" if spec.qk_norm else "mixtral"


def hf_config(spec: Architecture, max_seq_len: int, special: tuple[int, int, int] = (BOS_ID, EOS_ID, PAD_ID)) -> dict:
    """`special`: the tokenizer's (begin, end, padding) ids."""
    kind, m = family(spec), spec.moe
    if m.num_experts and m.router != "softmax" and kind != hf_deepseek.KIND:
        raise ConfigError(f"model.moe.router={m.router}: {FAMILIES[kind]} routes by softmax, so this model has no "
                          "Hugging Face form.")  # fmt: skip
    if m.num_experts and m.shared_experts and kind != hf_deepseek.KIND:
        raise ConfigError(f"model.moe.shared_experts={m.shared_experts}: {FAMILIES[kind]} has no shared experts, so "
                          "this model has no Hugging Face form here.")  # fmt: skip
    if kind == "mixtral" and (m.dense_layers or m.every > 1):
        raise ConfigError(f"model.moe.dense_layers={m.dense_layers}, every={m.every}: every Mixtral layer has "
                          "experts; with dense layers, use model.qk_norm=true for Qwen3-MoE's form.")  # fmt: skip
    if kind == "qwen3_moe" and m.dense_layers % m.every:
        raise ConfigError(f"model.moe.dense_layers={m.dense_layers} is not a multiple of every={m.every}: "
                          "Qwen3-MoE's decoder_sparse_step counts from the first layer.")  # fmt: skip
    config = {
        "architectures": [FAMILIES[kind]],
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
        "rope_scaling": {"rope_type": "llama3", **_llama3(spec)} if spec.rope_scaling.factor != 1 else None,  # 4.x
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"}  # 5.x
        if spec.rope_scaling.factor == 1
        else {"rope_theta": spec.rope_theta, "rope_type": "llama3", **_llama3(spec)},
        "tie_word_embeddings": spec.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special[0],
        "eos_token_id": special[1],
        "pad_token_id": special[2],
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    if kind == "gemma3_text":
        return _gemma3_config(spec, config)
    if kind == hf_deepseek.KIND:
        return hf_deepseek.config(spec, config)
    if kind == "mistral":
        config.update(sliding_window=spec.sliding_window)
    elif kind == "mixtral":
        config.update(num_local_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                      intermediate_size=spec.expert_d_ff, sliding_window=None, router_jitter_noise=0.0)  # fmt: skip
    elif kind == "qwen3_moe":
        config.update(num_experts=m.num_experts, num_local_experts=m.num_experts,  # transformers 4.x's, 5.x's
                      num_experts_per_tok=m.experts_per_token, norm_topk_prob=True,
                      moe_intermediate_size=spec.expert_d_ff, decoder_sparse_step=m.every,
                      mlp_only_layers=list(range(m.dense_layers)), use_sliding_window=False)  # fmt: skip
    return config


def _gemma3_config(spec: Architecture, common: dict) -> dict:
    """Gemma3TextConfig's keys (it refuses others'): each layer's type, each type's RoPE base."""
    if spec.rope_scaling.factor != 1:
        raise ConfigError("model.rope_scaling: Gemma 3's form here has no Llama 3 RoPE scaling; use factor=1.")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype")  # fmt: skip
    local_theta = spec.local_rope_theta or spec.rope_theta
    return {
        **{k: common[k] for k in keep},
        "architectures": [FAMILIES["gemma3_text"]],
        "model_type": "gemma3_text",
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


def _llama3(spec: Architecture) -> dict:
    r = spec.rope_scaling
    return {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_len}  # fmt: skip


def model_keys_from_hf(config: dict) -> dict:
    """Our model.* values for a Hugging Face config of one of the FAMILIES; refuses what our model does not
    implement."""
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(
            f"this Hugging Face model is of model_type {kind!r}, which this trainer does not read; it reads "
            f"{', '.join(f'{c} ({k})' for k, c in FAMILIES.items())}."
        )
    if kind == hf_deepseek.KIND:
        return hf_deepseek.model_keys(config)
    if kind == "gemma3_text":
        config = gemma3_as_published_now(config)
    # RoPE: transformers 5.x writes rope_parameters (Gemma 3: one per layer type), 4.x rope_scaling (None or
    # a dict) beside rope_theta.
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    local_rope = {}
    if kind == "gemma3_text":
        rope, local_rope = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    window = _window(config)
    layers = config["num_hidden_layers"]
    dense = sorted(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    unsupported = {
        "hidden_act": kind != "gemma3_text" and config.get("hidden_act", "silu") != "silu",
        "hidden_activation": kind == "gemma3_text" and config.get("hidden_activation") != "gelu_pytorch_tanh",
        "final_logit_softcapping": config.get("final_logit_softcapping") is not None,
        "attn_logit_softcapping": config.get("attn_logit_softcapping") is not None,
        "use_bidirectional_attention": bool(config.get("use_bidirectional_attention")),
        "layer_types": window is None,
        "attention_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "rope_scaling": rope_type not in ("default", "llama3") or (kind == "gemma3_text" and rope_type != "default")
        or local_rope.get("rope_type", "default") != "default",
        "sliding_window": kind in ("mixtral", "qwen3_moe", "qwen3") and bool(
            config.get("sliding_window") if kind == "mixtral" else config.get("use_sliding_window")),
        "norm_topk_prob": kind == "qwen3_moe" and not config.get("norm_topk_prob"),
        # Qwen3-MoE's layer i has experts if (i + 1) % decoder_sparse_step == 0, ours if (i - dense + 1) % every
        "decoder_sparse_step": kind == "qwen3_moe" and bool(len(dense) % step or (layers - len(dense)) % step),
        "mlp_only_layers": dense != list(range(len(dense))),  # our dense layers come first
    }  # fmt: skip
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise ConfigError(f"this Hugging Face model has {bad}, which this trainer's models do not implement.")
    heads = config["num_attention_heads"]
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    scaling = {}
    if rope_type == "llama3":
        scaling = {"rope_scaling.factor": float(rope["factor"]),
                   "rope_scaling.low_freq_factor": float(rope["low_freq_factor"]),
                   "rope_scaling.high_freq_factor": float(rope["high_freq_factor"]),
                   "rope_scaling.original_max_len": int(rope["original_max_position_embeddings"])}  # fmt: skip
    experts = {}
    if kind == "mixtral":
        experts = {"moe.num_experts": config["num_local_experts"], "moe.d_ff": config["intermediate_size"],
                   "moe.dense_layers": 0, "moe.every": 1}  # fmt: skip
    elif kind == "qwen3_moe":
        count = config.get("num_experts", config.get("num_local_experts"))  # 4.x's name, 5.x's
        experts = {"moe.num_experts": count, "moe.d_ff": config["moe_intermediate_size"],
                   "moe.dense_layers": len(dense), "moe.every": step}  # fmt: skip
    if experts:
        experts.update({"moe.experts_per_token": config["num_experts_per_tok"], "moe.shared_experts": 0})
    else:
        experts = {"moe.num_experts": 0}
    gemma = {}
    if kind == "gemma3_text":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        scale = config.get("query_pre_attn_scalar", head_dim)
        local_theta = float(local_rope.get("rope_theta", theta))
        gemma = {"embed_scale": True, "post_norms": True, "mlp_activation": "gelu_tanh",
                 "attn_scale_dim": 0 if scale == head_dim else int(scale),
                 "local_rope_theta": 0.0 if local_theta == float(theta) else local_theta}  # fmt: skip
    return {
        **scaling,
        **experts,
        **gemma,
        "sliding_window": window[0],
        "global_every": window[1],
        "vocab_size": config["vocab_size"],
        "d_model": config["hidden_size"],
        "n_layers": layers,
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "d_ff": config["intermediate_size"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "rope_theta": float(theta),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "qk_norm": kind in ("qwen3", "qwen3_moe", "gemma3_text"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # transformers' defaults


def gemma3_as_published_now(config: dict) -> dict:
    """A Gemma 3 config.json of any published form in today's (layer_types, rope_parameters per layer type),
    read as transformers' Gemma3TextConfig reads each: the Hub's own (google/gemma-3-1b-it) gives
    sliding_window_pattern (every n-th layer global, 6 if absent) and rope_theta with rope_local_base_freq;
    a form between the two gives layer_types with those two thetas."""
    pattern = config.get("sliding_window_pattern", 6)
    layers = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config["num_hidden_layers"])
    ]
    given = config.get("rope_parameters") or {}
    rope = {kind: dict(given.get(kind) or {"rope_type": "default"}) for kind in GEMMA3_THETA}
    if config.get("rope_scaling"):
        rope["full_attention"].update(config["rope_scaling"])
    rope["full_attention"].setdefault("rope_theta", config.get("rope_theta", GEMMA3_THETA["full_attention"]))
    rope["sliding_attention"].setdefault("rope_theta", config.get("rope_local_base_freq",
                                                                  GEMMA3_THETA["sliding_attention"]))  # fmt: skip
    return {**config, "layer_types": layers, "rope_parameters": rope, "rope_scaling": None,
            "sliding_window": config.get("sliding_window", 4096)}  # fmt: skip


def _window(config: dict) -> tuple[int, int] | None:
    """(model.sliding_window, model.global_every) for a config's layers; None if its pattern of local and
    global layers (Gemma 3's layer_types) is not every-n-th-global."""
    window = config.get("sliding_window") or 0
    if config.get("model_type") == "mistral":
        return window, 0
    if config.get("model_type") != "gemma3_text":
        return 0, 0
    local = [t == "sliding_attention" for t in config["layer_types"]]
    if not any(local) or not window:
        return 0, 0
    every = 0 if all(local) else local.index(False) + 1
    same = all(loc == bool(not every or (i + 1) % every) for i, loc in enumerate(local))
    return (window, every) if same else None


def _expert_names(kind: str, i: int, j: int) -> tuple[str, str, str]:
    """Layer i's expert j: the files' names of its gate, up and down projections."""
    if kind == "mixtral":
        return tuple(f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight" for w in ("w1", "w3", "w2"))
    return tuple(f"model.layers.{i}.mlp.experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down"))


def _router_name(kind: str, i: int) -> str:
    return f"model.layers.{i}.{'block_sparse_moe' if kind == 'mixtral' else 'mlp'}.gate.weight"


def _stacks(spec: Architecture) -> dict[str, list[int]]:
    """Our stacks of layers and the layer numbers each holds, in order."""
    stacks = {}
    for i, (stack, _) in enumerate(spec.stacks()):
        stacks.setdefault(stack, []).append(i)
    return stacks


def to_hf_tensors(params: dict, spec: Architecture) -> dict[str, np.ndarray]:
    kind = family(spec)
    norms, off = (GEMMA_NORMS, 1.0) if kind == "gemma3_text" else (NORMS, 0.0)
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"] - off}
    if not spec.tie_embeddings:
        # muP divides our logits by m; Llama has no output multiplier, so the head carries it
        # (muP refuses tied embeddings, so the input table is untouched).
        out["lm_head.weight"] = params["lm_head"].T / spec.width_multiplier
    d = spec.d_model
    for stack, numbers in _stacks(spec).items():
        layers = params[stack]
        for n, i in enumerate(numbers):
            a = layers["attn"]
            prefix = f"model.layers.{i}."
            if kind == hf_deepseek.KIND:
                out.update(hf_deepseek.attention_to_hf(a, n, prefix, spec))
            else:
                out[prefix + "self_attn.q_proj.weight"] = a["wq"][n].reshape(d, -1).T
                out[prefix + "self_attn.k_proj.weight"] = a["wk"][n].reshape(d, -1).T
                out[prefix + "self_attn.v_proj.weight"] = a["wv"][n].reshape(d, -1).T
                out[prefix + "self_attn.o_proj.weight"] = a["wo"][n].reshape(-1, d).T
            if spec.qk_norm:
                out[prefix + "self_attn.q_norm.weight"] = a["q_norm"]["scale"][n] - off
                out[prefix + "self_attn.k_norm.weight"] = a["k_norm"]["scale"][n] - off
            if "moe" in layers:
                m = layers["moe"]
                if kind == hf_deepseek.KIND:
                    out.update(hf_deepseek.moe_extras_to_hf(m, n, prefix))
                elif np.any(m["router_bias"][n] != 0):
                    raise ConfigError(f"layer {i}'s router bias (model.moe.router_bias) is not zero: "
                                      f"{FAMILIES[kind]} has no place for it.")  # fmt: skip
                out[_router_name(kind, i)] = m["router"][n].T
                for j in range(spec.moe.num_experts):
                    for name, w in zip(_expert_names(kind, i, j), ("w_gate", "w_up", "w_down"), strict=True):
                        out[name] = m[w][n, j].T
            else:
                for w, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                    out[prefix + f"mlp.{name}.weight"] = layers["mlp"][w][n].T
            for name, ours in norms.items():
                out[prefix + f"{name}.weight"] = layers[ours]["scale"][n] - off
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf_tensors(t: dict[str, np.ndarray], spec: Architecture, interleaved: bool = False) -> dict:
    """Our parameters from a family's tensors; `interleaved`: DeepSeek's RoPE rows in interleaved pairs."""
    kind = family(spec)
    norms, off = (GEMMA_NORMS, 1.0) if kind == "gemma3_text" else (NORMS, 0.0)
    d, n, k, h = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim
    params = {"embed": t["model.embed_tokens.weight"], "final_norm": {"scale": t["model.norm.weight"] + off}}
    for stack, numbers in _stacks(spec).items():

        def each(name, fn, numbers=numbers):
            return np.stack([fn(t[f"model.layers.{i}.{name}"]) for i in numbers])

        if kind == hf_deepseek.KIND:
            attn = hf_deepseek.attention_from_hf(t, numbers, spec, interleaved)
        else:
            attn = {
                "wq": each("self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h)),
                "wk": each("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, h)),
                "wv": each("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, h)),
                "wo": each("self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d)),
            }
        if spec.qk_norm:
            attn.update({f"{q}_norm": {"scale": each(f"self_attn.{q}_norm.weight", lambda w: w + off)} for q in "qk"})
        layers = {"attn": attn, **{ours: {"scale": each(f"{name}.weight", lambda w: w + off)}
                                   for name, ours in norms.items()}}  # fmt: skip
        if stack == "layers" and spec.moe.num_experts:
            experts = range(spec.moe.num_experts)
            names = {i: [_expert_names(kind, i, j) for j in experts] for i in numbers}
            layers["moe"] = {
                "router": np.stack([t[_router_name(kind, i)].T for i in numbers]),
                "router_bias": np.zeros((len(numbers), spec.moe.num_experts), np.float32),
                **{w: np.stack([np.stack([t[names[i][j][c]].T for j in experts]) for i in numbers])
                   for c, w in enumerate(("w_gate", "w_up", "w_down"))},
            }  # fmt: skip
            if kind == hf_deepseek.KIND:
                layers["moe"].update(hf_deepseek.moe_extras_from_hf(t, numbers))
        else:
            layers["mlp"] = {w: each(f"mlp.{name}.weight", lambda x: x.T) for w, name in
                             (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))}  # fmt: skip
        params[stack] = layers
    if not spec.tie_embeddings:
        params["lm_head"] = t["lm_head.weight"].T * spec.width_multiplier  # undo the export's muP folding
    return _as_float32(params)


def _as_float32(tree):
    if isinstance(tree, dict):
        return {k: _as_float32(v) for k, v in tree.items()}
    return np.ascontiguousarray(tree, np.float32)
