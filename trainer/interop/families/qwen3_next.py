"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type qwen3_next): Qwen3.5-MoE's arithmetic (qwen3_5.py: Gated
DeltaNet layers beside gated full attention, softmax-routed experts and a gated shared expert in every layer)
in an older file layout. A linear layer's q, k, v and z come from one projection, in_proj_qkvz, whose rows are
grouped by key head (each key head's q, its k, then the v and z of the value heads it serves), and b and a
from one, in_proj_ba, grouped the same way; the convolution's channels are q's, k's, then v's, as Qwen3.5's.

Our model of it is Qwen3.5-MoE's, so no architecture is claimed here: a run imported from Qwen3-Next keeps
that form in its workdir (trainer/interop/beside.py) and its export writes Qwen3-Next again. Experts in
every layer only (decoder_sparse_step 1, no mlp_only_layers) and norm_topk_prob, or none at all.
"""

from __future__ import annotations

import numpy as np

from trainer.interop.families import core, qwen3_5
from trainer.model.spec import Architecture

CLASSES = {"qwen3_next": "Qwen3NextForCausalLM"}


def _sizes(spec: Architecture) -> tuple[int, int, int, int]:
    """(key heads, key width, value heads a key head serves x value width, value heads a key head serves)."""
    lin = spec.linear
    per = lin.value_heads // lin.key_heads
    return lin.key_heads, lin.key_dim, per * lin.value_dim, per


def linear_to_hf(a: dict, n: int, prefix: str, spec: Architecture) -> dict:
    """Qwen3.5's tensors of layer `n`, with q, k, v, z and b, a fused into Qwen3-Next's grouped projections."""
    out, p, d = qwen3_5.linear_to_hf(a, n, prefix, spec), prefix + "linear_attn.", spec.d_model
    heads, key, value, per = _sizes(spec)
    q, k, v = np.split(out.pop(p + "in_proj_qkv.weight"), np.cumsum([heads * key, heads * key]))
    z = out.pop(p + "in_proj_z.weight")
    grouped = [
        q.reshape(heads, key, d),
        k.reshape(heads, key, d),
        v.reshape(heads, value, d),
        z.reshape(heads, value, d),
    ]
    out[p + "in_proj_qkvz.weight"] = np.concatenate(grouped, axis=1).reshape(-1, d)
    b, a_ = (out.pop(p + f"in_proj_{c}.weight").reshape(heads, per, d) for c in "ba")
    out[p + "in_proj_ba.weight"] = np.concatenate([b, a_], axis=1).reshape(-1, d)
    return out


def linear_from_hf(t: dict, numbers: list[int], spec: Architecture) -> dict:
    heads, key, value, per = _sizes(spec)
    view = dict(t)
    for i in numbers:
        p, d = f"model.layers.{i}.linear_attn.", spec.d_model
        q, k, v, z = np.split(t[p + "in_proj_qkvz.weight"].reshape(heads, -1, d), np.cumsum([key, key, value]), axis=1)
        view[p + "in_proj_qkv.weight"] = np.concatenate([x.reshape(-1, d) for x in (q, k, v)])
        view[p + "in_proj_z.weight"] = z.reshape(-1, d)
        b, a_ = np.split(t[p + "in_proj_ba.weight"].reshape(heads, 2 * per, d), 2, axis=1)
        view[p + "in_proj_b.weight"], view[p + "in_proj_a.weight"] = b.reshape(-1, d), a_.reshape(-1, d)
    return qwen3_5.linear_from_hf(view, numbers, spec)


LAYOUT = core.Layout(norm_offset=1.0, attention_to_hf=qwen3_5.gated_attention_to_hf,
                     attention_from_hf=qwen3_5.gated_attention_from_hf, linear_to_hf=linear_to_hf,
                     linear_from_hf=linear_from_hf, moe_extras_to_hf=qwen3_5.shared_to_hf,
                     moe_extras_from_hf=qwen3_5.shared_from_hf)  # fmt: skip


def claims(spec: Architecture) -> str | None:
    return None  # Qwen3.5's family claims this arithmetic; Qwen3-Next is written for a run imported from it


def config(spec: Architecture, common: dict) -> dict:
    kind = qwen3_5.claims(spec)
    out = qwen3_5.config(spec, {**common, "model_type": kind})
    experts = bool(spec.moe.num_experts)
    return {**out, "architectures": [CLASSES["qwen3_next"]], "model_type": "qwen3_next",
            "intermediate_size": spec.d_ff, "num_experts": spec.moe.num_experts if experts else 0,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}  # fmt: skip


def model_keys(config: dict) -> dict:
    experts = config.get("num_experts", 0) > 0
    core.refuse(config, {"decoder_sparse_step": experts and config.get("decoder_sparse_step", 1) != 1,
                         "mlp_only_layers": experts and bool(config.get("mlp_only_layers")),
                         "norm_topk_prob": experts and not config.get("norm_topk_prob", True)})  # fmt: skip
    return qwen3_5.model_keys({**config, "model_type": "qwen3_5_moe_text" if experts else "qwen3_5_text"})
