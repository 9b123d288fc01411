"""Mixtral (`MixtralForCausalLM`): Llama's attention, and softmax-routed experts in every layer, each
expert's gate, up and down projections its w1, w3 and w2 (the per-expert files `save_pretrained` writes;
transformers fuses them on loading). Mixtral renormalises the top-k weights as we do; it has no dense
layers, no shared experts and no router bias, which an export refuses."""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.interop.families import core
from trainer.model.spec import Architecture

CLASSES = {"mixtral": "MixtralForCausalLM"}


def expert_names(i: int, j: int) -> tuple[str, str, str]:
    return tuple(f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight" for w in ("w1", "w3", "w2"))


def router_name(i: int) -> str:
    return f"model.layers.{i}.block_sparse_moe.gate.weight"


LAYOUT = core.Layout(expert_names=expert_names, router_name=router_name)


def claims(spec: Architecture) -> str | None:
    return "mixtral" if core.plain(spec) and spec.moe.num_experts and not spec.qk_norm else None


def config(spec: Architecture, common: dict) -> dict:
    m = spec.moe
    core.refuse_other_routers(spec, CLASSES["mixtral"])
    if m.dense_layers or m.every > 1:
        raise ConfigError(f"model.moe.dense_layers={m.dense_layers}, every={m.every}: every Mixtral layer has "
                          "experts; with dense layers, use model.qk_norm=true for Qwen3-MoE's form.")  # fmt: skip
    return {**common, "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "intermediate_size": spec.expert_d_ff, "sliding_window": None, "router_jitter_noise": 0.0}  # fmt: skip


def model_keys(config: dict) -> dict:
    keys = core.model_keys(config, core.rope_of(config), {"sliding_window": bool(config.get("sliding_window"))})
    keys.update(core.expert_keys(config, config["num_local_experts"], config["intermediate_size"], 0, 1))
    return keys
