"""What the model section's kinds of layer need, before any device is asked: experts, local and global
layers, latent attention, multi-token prediction (trainer/training/validation.py runs these with every other check).
"""

from __future__ import annotations

import ml_collections

from trainer.config import (
    ACTIVATIONS,
    ADAPTER_BASES,
    ADAPTER_TARGETS,
    GROUPED_MATMULS,
    LAYER_TYPES,
    MOE_IMPLS,
    QUANT_MATMULS,
    QUANT_TARGETS,
    ROUTERS,
)
from trainer.config.errors import ConfigError


def choice(path: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{path}={value!r} is not one of {', '.join(str(v) or repr(v) for v in valid)}.")


def check_layers(cfg: ml_collections.ConfigDict) -> None:
    _check_moe(cfg)
    _check_hybrid(cfg)
    _check_window(cfg)
    _check_latent(cfg)
    _check_mtp(cfg)
    _check_adapters(cfg)
    _check_quant(cfg)


def _check_quant(cfg: ml_collections.ConfigDict) -> None:
    """What quantised matmuls (model.quant, trainer/model/low_precision.py) need: known targets that name a
    matmul this model has, and experts computed by einsums (the capacity form), which take quantised operands;
    the grouped-matmul kernels of the dropless form do not. (fp8 on a TPU is refused where the devices are
    known: trainer/training/setup.py.)"""
    q, e = cfg.model.quant, cfg.model.moe
    choice("model.quant.matmul", q.matmul, QUANT_MATMULS)
    if not q.matmul:
        return
    unknown = [t for t in q.targets if t not in QUANT_TARGETS]
    dense = not e.num_experts or e.dense_layers > 0 or e.every > 1 or e.shared_experts > 0
    present = {"attention", "logits", *(["mlp"] * dense), *(["experts"] * bool(e.num_experts))}
    if unknown or not present & set(q.targets):
        said = f"names {','.join(unknown)}, which is not a matmul" if unknown else "matches no matmul of this model"
        raise ConfigError(f"model.quant.targets={','.join(q.targets)!r} {said}; the targets: "
                          f"{','.join(t for t in QUANT_TARGETS if t in present)}.")  # fmt: skip
    if "experts" in q.targets and e.num_experts and e.impl != "capacity":
        raise ConfigError(f"model.quant.matmul={q.matmul} of the experts: model.moe.impl={e.impl} runs them as "
                          "grouped-matmul kernels, which take no quantised operands; set model.moe.impl=capacity, or "
                          "leave experts out of model.quant.targets.")  # fmt: skip


def _check_adapters(cfg: ml_collections.ConfigDict) -> None:
    """What low-rank adapters (model.lora.rank > 0) need: known projections, a base to adapt, no stages."""
    a = cfg.model.lora
    choice("model.lora.base", a.base, ADAPTER_BASES)
    if a.base and not a.rank:
        raise ConfigError(f"model.lora.base={a.base} quantises the frozen base beside adapters (QLoRA); set "
                          "model.lora.rank > 0 too, or model.lora.base=''.")  # fmt: skip
    if not a.rank:
        return
    unknown = [t for t in a.targets if t not in ADAPTER_TARGETS]
    if unknown or not a.targets:
        raise ConfigError(f"model.lora.targets={','.join(a.targets)!r} names {','.join(unknown) or 'nothing'}; the "
                          f"projections that take adapters: {','.join(ADAPTER_TARGETS)}.")  # fmt: skip
    latent = sorted({"q", "k", "v", "o"} & set(a.targets), key=ADAPTER_TARGETS.index)
    if cfg.model.mla.kv_rank and latent:
        raise ConfigError(f"model.lora.targets={','.join(a.targets)}: latent attention's projections "
                          f"(model.mla.kv_rank > 0) take no adapters here; leave out {','.join(latent)}.")  # fmt: skip
    if not cfg.checkpoint.init_from:
        raise ConfigError("model.lora.rank > 0 trains adapters beside frozen weights: give them with "
                          "--config.checkpoint.init_from=DIR (a run, or convert_hf.py import's output).")  # fmt: skip
    if cfg.mesh.stage > 1:
        raise ConfigError(f"model.lora.rank > 0 with mesh.stage={cfg.mesh.stage}: adapters do not run through "
                          "pipeline stages; use mesh.stage=1 (fsdp holds a model's layers instead).")  # fmt: skip


def _check_latent(cfg: ml_collections.ConfigDict) -> None:
    """What latent attention needs (trainer/model/latent.py), and DeepSeek-V3's router's groups."""
    m, e = cfg.model, cfg.model.moe
    choice("model.moe.router", e.router, ROUTERS)
    if e.num_experts and e.router == "sigmoid" and e.groups > 1:
        if e.num_experts % e.groups or e.groups_per_token > e.groups:
            raise ConfigError(f"model.moe.groups={e.groups} must divide model.moe.num_experts={e.num_experts}, and "
                              f"groups_per_token={e.groups_per_token} may not exceed it.")  # fmt: skip
        if e.experts_per_token > e.groups_per_token * (e.num_experts // e.groups):
            per_group = e.num_experts // e.groups
            raise ConfigError(f"model.moe.experts_per_token={e.experts_per_token} exceeds the experts of "
                              f"groups_per_token={e.groups_per_token} groups of {per_group}.")  # fmt: skip
    a = m.mla
    if not a.kv_rank:
        return
    if a.rope_dim % 2:
        raise ConfigError(f"model.mla.rope_dim={a.rope_dim} must be even for RoPE.")
    if a.v_dim > a.nope_dim + a.rope_dim:
        raise ConfigError(f"model.mla.v_dim={a.v_dim} exceeds a query head's nope_dim + rope_dim = "
                          f"{a.nope_dim + a.rope_dim}, which the fused kernels' one head width needs.")  # fmt: skip
    for key in ("sliding_window", "qk_norm", "attn_scale_dim", "attention_sinks"):
        if m[key]:
            raise ConfigError(f"model.{key}={m[key]} with latent attention (model.mla.kv_rank={a.kv_rank}) is not "
                              f"implemented; use one or the other.")  # fmt: skip


def _check_mtp(cfg: ml_collections.ConfigDict) -> None:
    """What multi-token prediction's modules need (trainer/model/mtp.py): the sequence in its own order."""
    depth = cfg.model.mtp.depth
    if not depth:
        return
    for key, what in (("mesh.stage", "pipeline stages"), ("mesh.context", "the context axis")):
        section, name = key.split(".")
        if cfg[section][name] > 1:
            raise ConfigError(f"model.mtp.depth={depth} with {key}={cfg[section][name]}: multi-token prediction "
                              f"with {what} is not supported; use {key}=1, or model.mtp.depth=0.")  # fmt: skip
    if cfg.data.format == "preference":
        raise ConfigError(f"model.mtp.depth={depth} with DPO (data.format=preference): DPO scores the next token "
                          "alone; set model.mtp.depth=0 (the modules' weights are then not read).")  # fmt: skip
    if depth >= cfg.data.seq_len - 1:
        raise ConfigError(f"model.mtp.depth={depth} leaves no target in a sequence of data.seq_len={cfg.data.seq_len}.")


def _check_hybrid(cfg: ml_collections.ConfigDict) -> None:
    """What a hybrid of Gated DeltaNet and full attention needs (trainer/model/delta.py)."""
    m = cfg.model
    head = m.head_dim or m.d_model // m.n_heads
    if m.rope_fraction != 1.0 and int(head * m.rope_fraction) % 2:
        raise ConfigError(f"model.rope_fraction={m.rope_fraction} of a {head}-wide head rotates "
                          f"{int(head * m.rope_fraction)} dims, an odd count; RoPE rotates pairs.")  # fmt: skip
    types = tuple(m.layer_types)
    if not types:
        return
    for kind in types:
        choice("model.layer_types' entry", kind, LAYER_TYPES)
    if len(types) != m.n_layers:
        raise ConfigError(f"model.layer_types has {len(types)} entries for model.n_layers={m.n_layers} layers; give "
                          "one kind per layer.")  # fmt: skip
    lin = m.linear
    if lin.value_heads % lin.key_heads:
        raise ConfigError(f"model.linear.value_heads={lin.value_heads} is not a multiple of model.linear.key_heads="
                          f"{lin.key_heads}; each key head serves a whole group of value heads.")  # fmt: skip
    others = [(m.sliding_window, f"model.sliding_window={m.sliding_window}"), (m.mla.kv_rank, "latent attention "
              "(model.mla.kv_rank)"),
              (m.moe.num_experts and (m.moe.dense_layers or m.moe.every > 1), "dense layers among its experts "
               f"(model.moe.dense_layers={m.moe.dense_layers}, every={m.moe.every}: experts go in every layer)"),
              (m.moe.num_experts and (m.moe.router != "softmax" or m.moe.router_bias), "a router other than softmax "
               f"without bias (model.moe.router={m.moe.router}, router_bias={m.moe.router_bias})"),
              (m.mtp.depth, "multi-token prediction (model.mtp.depth)"), (cfg.mesh.stage > 1, f"mesh.stage="
              f"{cfg.mesh.stage} (pipeline stages)")]  # fmt: skip
    for on, what in others:
        if on:
            raise ConfigError(f"a hybrid with linear-attention layers (model.layer_types) and {what} is not "
                              "supported here; use one or the other.")  # fmt: skip


def _check_window(cfg: ml_collections.ConfigDict) -> None:
    """What local layers and Gemma's MLP need (trainer/model/attention.py, primitives.py)."""
    m = cfg.model
    choice("model.mlp_activation", m.mlp_activation, ACTIVATIONS)
    if m.moe.num_experts and m.mlp_activation != "silu":
        raise ConfigError(f"model.mlp_activation={m.mlp_activation} with experts: the experts are SwiGLU MLPs; "
                          "use silu, or a dense model.")  # fmt: skip
    w = m.sliding_window
    if not w:
        return
    if w >= m.max_seq_len:
        raise ConfigError(f"model.sliding_window={w} is not shorter than model.max_seq_len={m.max_seq_len}, so "
                          f"every local layer would attend as a global one does; use a window below "
                          f"{m.max_seq_len}, or 0 for global attention everywhere.")  # fmt: skip
    if m.global_every == 1:
        raise ConfigError("model.global_every=1 makes every layer global; use model.sliding_window=0 for that, or "
                          "a pattern such as 6 (five local layers, then a global one).")  # fmt: skip
    if m.moe.num_experts:
        raise ConfigError(f"model.sliding_window={w} with experts (model.moe.num_experts={m.moe.num_experts}) is "
                          "not implemented here; use one or the other.")  # fmt: skip
    if cfg.mesh.stage > 1:
        raise ConfigError(f"model.sliding_window={w} with mesh.stage={cfg.mesh.stage}: local layers inside "
                          "pipeline stages are not supported; use mesh.stage=1.")  # fmt: skip


def _check_moe(cfg: ml_collections.ConfigDict) -> None:
    """What a mixture of experts needs (trainer/model/moe.py), before any mesh exists."""
    m = cfg.model.moe
    choice("model.moe.impl", m.impl, MOE_IMPLS)
    choice("model.moe.grouped_matmul", m.grouped_matmul, GROUPED_MATMULS)
    if not m.num_experts:
        return
    if m.shared_gate and not m.shared_experts:
        raise ConfigError("model.moe.shared_gate=true gates the shared experts' output, and model.moe.shared_experts "
                          "is 0; add a shared expert or set shared_gate=false.")  # fmt: skip
    if m.experts_per_token > m.num_experts:
        raise ConfigError(
            f"model.moe.experts_per_token={m.experts_per_token} exceeds model.moe.num_experts={m.num_experts}: "
            "a token cannot go to more experts than there are; lower it or add experts."
        )
    if m.dense_layers >= cfg.model.n_layers:
        raise ConfigError(
            f"model.moe.dense_layers={m.dense_layers} leaves none of the model.n_layers={cfg.model.n_layers} layers "
            "for experts; use fewer dense layers, or model.moe.num_experts=0 for a dense model."
        )
    rest = cfg.model.n_layers - m.dense_layers
    if rest % m.every:
        raise ConfigError(
            f"the {rest} layers after model.moe.dense_layers={m.dense_layers} do not split into units of "
            f"model.moe.every={m.every} (every-1 dense layers, then one with experts); make {rest} a multiple of "
            f"{m.every}."
        )
    if cfg.mesh.stage > 1:
        raise ConfigError(
            f"model.moe.num_experts={m.num_experts} with mesh.stage={cfg.mesh.stage}: experts inside pipeline "
            "stages are not supported; use mesh.stage=1 (spread the experts with mesh.expert)."
        )
