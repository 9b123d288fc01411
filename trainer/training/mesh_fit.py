"""The config against the mesh it will run on, before anything is placed: `check_mesh_fit` the batch, the
experts and the context axis; `check_weights_fit` every weight against the mesh axes its rule splits it over;
`check_adapters` model.lora.targets against the projections the model has."""

from __future__ import annotations

import math

import jax
import ml_collections

from trainer.config import ADAPTER_TARGETS, microbatch_size
from trainer.config.errors import ConfigError
from trainer.model import adapters


def check_mesh_fit(cfg: ml_collections.ConfigDict, mesh) -> None:
    """Refuse a batch or head count that does not divide over the mesh."""
    _check_experts(cfg, mesh.shape["expert"], mesh.shape["tensor"])
    data_ways = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    micro = microbatch_size(cfg)
    if micro % data_ways:
        raise ConfigError(
            f"each microbatch of {micro} sequences (train.global_batch_size / train.grad_accum_steps) "
            f"does not divide over data x fsdp x expert = {data_ways} devices; make it a multiple of {data_ways}."
        )
    piece = micro // cfg.train.pipeline_microbatches
    if piece % data_ways:
        raise ConfigError(
            f"each pipeline microbatch of {piece} sequences does not divide over data x fsdp = "
            f"{data_ways} devices; use fewer train.pipeline_microbatches or a larger batch."
        )
    _check_context(cfg, mesh.shape["context"])


# The config key that sizes each logical axis of a weight, named when that axis does not divide over its mesh
# axes; in the order the checks report them.
SIZED_BY = {"heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "mlp": "model.d_ff", "vocab": "model.vocab_size",
            "embed": "model.d_model", "expert": "model.moe.num_experts", "head_dim": "model.head_dim",
            "layers": "model.n_layers", "q_latent": "model.mla.q_rank", "kv_latent": "model.mla.kv_rank",
            "lora": "model.lora.rank"}  # fmt: skip


LINEAR_SIZED_BY = {"heads": "model.linear.value_heads", "kv_heads": "model.linear.key_heads",
                   "head_dim": "model.linear.value_dim"}  # fmt: skip


def check_adapters(model) -> None:
    """Refuse model.lora.targets that name a projection this model has none of (a mixture without shared
    experts has no gate, up or down outside its routed experts, which take none; a model without Gated
    DeltaNet layers no qkv, z or out). The default, every target, adapts whatever the model has."""
    lora = model.arch.lora
    if not lora.rank:
        return
    found = adapters.count(model.abstract_params)
    missing = [t for t in lora.targets if t not in found] if tuple(lora.targets) != ADAPTER_TARGETS else []
    if not found:
        missing = list(lora.targets)
    if missing:
        raise ConfigError(f"model.lora.targets names {','.join(missing)}, which this model has none of; the "
                          f"projections it adapts: {','.join(t for t in ADAPTER_TARGETS if t in found) or 'none'} "
                          "(routed experts and latent attention take no adapters).")  # fmt: skip


def check_weights_fit(model, shard) -> None:
    """Refuse a weight whose dimension the mesh axes of its rule (mesh.rules over the defaults) do not divide,
    before anything is placed. Derived from every weight's logical axes and the rules as the sharding applies
    them, so a custom rule, or an axis that shares a dimension (embed over fsdp, context and expert), is
    checked like any other."""
    found = []

    def check(path, names, param):
        where = ".".join(str(getattr(k, "key", k)) for k in path)
        for size, name, entry in zip(param.shape, names, shard.spec(names), strict=True):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            ways = math.prod(shard.mesh.shape[a] for a in axes)
            if size % ways:
                found.append((list(SIZED_BY).index(name) if name in SIZED_BY else len(SIZED_BY), name, size, axes,
                              ways, where))  # fmt: skip

    jax.tree_util.tree_map_with_path(check, model.logical_names, model.abstract_params,
                                     is_leaf=lambda x: isinstance(x, tuple))  # fmt: skip
    if not found:
        return
    _, name, size, axes, ways, where = min(found)
    key = "model.moe.d_ff" if name == "mlp" and ".moe." in f".{where}." else SIZED_BY.get(name, f"the '{name}' axis")
    if where.startswith("linear_layers.") and name in LINEAR_SIZED_BY:  # a Gated DeltaNet layer's heads
        key = LINEAR_SIZED_BY[name]
    over = " x ".join(f"mesh.{a}" for a in axes)
    raise ConfigError(
        f"{key}={size} does not divide over {over}={ways} (mesh.rules.{name} splits the '{name}' axis of the weight "
        f"'{where}' over {'them' if len(axes) > 1 else 'it'}); choose axis sizes whose product divides {size}, or "
        f"change mesh.rules.{name}."
    )


def _check_experts(cfg: ml_collections.ConfigDict, expert: int, tensor: int) -> None:
    m = cfg.model.moe
    if expert > 1 and not m.num_experts:
        raise ConfigError(
            f"mesh.expert={expert} splits experts, but the model has none (model.moe.num_experts=0); put those "
            "devices on mesh.data or mesh.fsdp."
        )
    if m.num_experts % expert:
        raise ConfigError(
            f"model.moe.num_experts={m.num_experts} does not divide over mesh.expert={expert}; use an expert axis "
            f"that divides {m.num_experts}."
        )
    width = m.d_ff or cfg.model.d_ff
    if m.num_experts and width % tensor:
        raise ConfigError(f"each expert's d_ff={width} (model.moe.d_ff) does not divide over mesh.tensor={tensor}.")


def _check_context(cfg: ml_collections.ConfigDict, context: int) -> None:
    """What context parallelism needs (trainer/model/context.py): zig-zag halves, no pipeline, and blocks in XLA
    or a fused kernel (splash, cudnn) over the gathered keys."""
    if context == 1:
        return
    if cfg.model.layer_types:
        raise ConfigError(f"a hybrid with linear-attention layers (model.layer_types) and mesh.context={context} is "
                          "not supported here: the recurrent state runs through the whole sequence; use "
                          "mesh.context=1.")  # fmt: skip
    seq = cfg.data.seq_len
    if seq % (2 * context):
        raise ConfigError(
            f"data.seq_len={seq} does not split into 2 x {context} equal chunks for the context axis of {context} "
            f"devices (each holds two, zig-zag, to balance causal work); use a multiple of {2 * context}."
        )
    if cfg.mesh.stage > 1:
        raise ConfigError(
            f"mesh.context={context} with mesh.stage={cfg.mesh.stage}: context parallelism inside pipeline stages "
            "is not supported; use one of the two."
        )
    fused_gathered = cfg.model.attention in ("splash", "cudnn") and cfg.model.context_attention == "all_gather"
    if cfg.model.attention not in ("xla", "auto") and not fused_gathered:
        raise ConfigError(
            f"model.attention={cfg.model.attention} cannot take the context axis's blocks with "
            f"model.context_attention={cfg.model.context_attention} (the blocks' softmax is merged in XLA); set "
            "model.attention=xla or auto, or splash or cudnn with model.context_attention=all_gather, or "
            "mesh.context=1."
        )
