"""Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`): query/key norms, and in the mixture
softmax-routed experts (gate_proj, up_proj, down_proj each) after `mlp_only_layers` dense ones, in every
`decoder_sparse_step`-th layer. Qwen3-MoE renormalises the top-k weights as we do only with norm_topk_prob,
which an import requires; its layer i has experts if (i + 1) % decoder_sparse_step == 0, ours if
(i - dense + 1) % every == 0, so the dense layers come first and their count is a multiple of the step."""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
LAYOUT = core.Layout()


def claims(spec: Architecture) -> str | None:
    if not (core.plain(spec) and spec.qk_norm and not spec.sliding_window):
        return None
    return "qwen3_moe" if spec.moe.num_experts else "qwen3"


def config(spec: Architecture, common: dict) -> dict:
    m = spec.moe
    if not m.num_experts:
        return common
    core.refuse_other_routers(spec, CLASSES["qwen3_moe"])
    if m.dense_layers % m.every:
        raise ConfigError(f"model.moe.dense_layers={m.dense_layers} is not a multiple of every={m.every}: "
                          "Qwen3-MoE's decoder_sparse_step counts from the first layer.")  # fmt: skip
    return {**common, "num_experts": m.num_experts, "num_local_experts": m.num_experts,  # transformers 4.x's, 5.x's
            "num_experts_per_tok": m.experts_per_token, "norm_topk_prob": True,
            "moe_intermediate_size": spec.expert_d_ff, "decoder_sparse_step": m.every,
            "mlp_only_layers": list(range(m.dense_layers)), "use_sliding_window": False}  # fmt: skip


def model_keys(config: dict) -> dict:
    moe = config.get("model_type") == "qwen3_moe"
    layers, dense, step = config["num_hidden_layers"], sorted(config.get("mlp_only_layers") or []), 1
    if moe:
        step = config.get("decoder_sparse_step", 1)
    keys = core.model_keys(config, core.rope_of(config), {
        "sliding_window": bool(config.get("use_sliding_window")),
        "norm_topk_prob": moe and not config.get("norm_topk_prob"),
        "decoder_sparse_step": moe and bool(len(dense) % step or (layers - len(dense)) % step),
        "mlp_only_layers": dense != list(range(len(dense))),  # our dense layers come first
    })  # fmt: skip
    keys["qk_norm"] = True
    if moe:
        count = config.get("num_experts", config.get("num_local_experts"))  # 4.x's name, 5.x's
        keys.update(core.expert_keys(config, count, config["moe_intermediate_size"], len(dense), step))
    return keys
