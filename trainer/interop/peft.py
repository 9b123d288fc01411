"""Low-rank adapters in Hugging Face PEFT's form, both ways: a directory of `adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads on the exported base model.

PEFT keeps each adapted projection's lora_A as (rank, in features) and lora_B as (out features, rank), and
adds (lora_alpha / r) * B @ A to the (out, in) weight. Ours are A (inputs..., rank) and B (rank, outputs...)
beside a weight stored (in, out) with heads folded as the families fold them (families/core.py), so each
maps by a reshape and a transpose. Attention's and dense MLPs' projections move, and a Gated DeltaNet layer's
(Qwen3.5's in_proj_qkv, in_proj_z and out_proj); adapters on a mixture's shared experts do not (their names
differ by family) and are refused. A model inside a larger one (trainer/interop/beside.py) has its layers
under another module path (model.language_model.layers): `modules` names it.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from trainer.config.errors import ConfigError
from trainer.interop import hf_files
from trainer.interop.families.core import layers_by_stack
from trainer.model.spec import Architecture

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# target -> (our block, the family's module below model.layers.N)
PROJECTIONS = {"q": ("attn", "self_attn.q_proj"), "k": ("attn", "self_attn.k_proj"), "v": ("attn", "self_attn.v_proj"),
               "o": ("attn", "self_attn.o_proj"), "gate": ("mlp", "mlp.gate_proj"), "up": ("mlp", "mlp.up_proj"),
               "down": ("mlp", "mlp.down_proj"), "qkv": ("attn", "linear_attn.in_proj_qkv"),
               "z": ("attn", "linear_attn.in_proj_z"), "out": ("attn", "linear_attn.out_proj")}  # fmt: skip
LINEAR = ("qkv", "z", "out")  # a Gated DeltaNet layer's targets; the others' attention's are q, k, v and o
MODULES = "model.layers"  # the projections' module names in the base model: model.layers.N.self_attn.q_proj
# init_lora_weights whose initialisation PEFT runs again on load, rewriting the base layer's weight (PEFT 0.21's
# tuners/lora/layer.py: pissa*, corda*, olora, loftq and lora_ga assign base_layer.weight); True, False,
# "gaussian", "eva", "orthogonal" and "mica" only set the adapters, which the saved tensors then replace.
BASE_REWRITING = ("pissa", "corda", "olora", "loftq", "lora_ga")
# adapter_config.json fields that leave the adapted model's arithmetic alone (metadata, how the adapters were
# initialised or trained); r, lora_alpha, target_modules, alpha_pattern and rank_pattern are read.
NEUTRAL = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
           "inference_mode", "lora_dropout", "init_lora_weights", "loftq_config", "eva_config", "corda_config",
           "lora_ga_config", "megatron_core", "runtime_config", "qalora_group_size", "r", "lora_alpha",
           "target_modules", "alpha_pattern", "rank_pattern"}  # fmt: skip


def present(spec: Architecture, layer: int | None = None) -> list[str]:
    """The targets whose projections the model has (in layer `layer`, or in any), in ADAPTER_TARGETS' order."""
    layers = range(spec.n_layers) if layer is None else [layer]
    linear = [spec.is_linear(i) for i in layers]
    return [t for t in PROJECTIONS if (any(linear) if t in LINEAR else not all(linear) or PROJECTIONS[t][0] == "mlp")]


def to_peft(added: dict, spec: Architecture, modules: str = MODULES) -> dict[str, np.ndarray]:
    """The adapters of a parameter tree (adapters.split's first part) as PEFT's tensors."""
    prefix, out = f"base_model.model.{modules}", {}
    for stack, numbers in layers_by_stack(spec).items():
        layers = added.get(stack, {})
        if "lora_gate" in layers.get("moe", {}).get("shared", {}):
            raise ConfigError("adapters on a mixture's shared experts have no PEFT form here; train with "
                              "model.lora.targets=q,k,v,o to export an adapter.")  # fmt: skip
        for target, (block, theirs) in PROJECTIONS.items():
            adapter = layers.get(block, {}).get(f"lora_{target}")
            if adapter is None:
                continue
            a, b = np.asarray(adapter["a"], np.float32), np.asarray(adapter["b"], np.float32)
            rank = a.shape[-1]
            for n, i in enumerate(numbers):
                out[f"{prefix}.{i}.{theirs}.lora_A.weight"] = np.ascontiguousarray(a[n].reshape(-1, rank).T)
                out[f"{prefix}.{i}.{theirs}.lora_B.weight"] = np.ascontiguousarray(b[n].reshape(rank, -1).T)
    return out


def from_peft(tensors: dict[str, np.ndarray], abstract: dict, spec: Architecture, saved: dict | None = None,
              modules: str = MODULES) -> dict:  # fmt: skip
    """Our adapters from PEFT's tensors, shaped as `abstract` (the adapters' part of the model's abstract
    parameters) says; a tensor missing or of another shape is one sentence. `saved`: the adapter_config.json,
    whose alpha_pattern gives a module its own alpha: folded into its B, as ours share one scale."""
    out: dict = {}
    for stack, numbers in layers_by_stack(spec).items():
        for target, (block, theirs) in PROJECTIONS.items():
            want = abstract.get(stack, {}).get(block, {}).get(f"lora_{target}")
            if want is None:
                continue
            parts = {}
            for ours, name in (("a", "lora_A"), ("b", "lora_B")):
                shape = tuple(want[ours].shape[1:])  # A: (inputs..., rank), B: (rank, outputs...)
                theirs_shape = (shape[-1], int(np.prod(shape[:-1]))) if ours == "a" else (int(np.prod(shape[1:])),
                                                                                           shape[0])  # fmt: skip
                stacked = []
                for i in numbers:
                    key = f"base_model.model.{modules}.{i}.{theirs}.{name}.weight"
                    if key not in tensors:
                        raise ConfigError(f"the adapter has no {key}; it was trained for other target modules "
                                          "than model.lora.targets says.")  # fmt: skip
                    if tuple(tensors[key].shape) != theirs_shape:
                        raise ConfigError(f"the adapter's {key} is {tuple(tensors[key].shape)}, where this config's "
                                          f"model and rank make {theirs_shape}: an adapter of another base model or "
                                          "rank.")  # fmt: skip
                    weight = np.asarray(tensors[key], np.float32).T.reshape(shape)
                    if ours == "b" and saved is not None:
                        weight = weight * (_per_module(saved, "alpha_pattern", f"{modules}.{i}.{theirs}",
                                                       saved["lora_alpha"]) / saved["lora_alpha"])  # fmt: skip
                    stacked.append(weight)
                parts[ours] = np.stack(stacked)
            out.setdefault(stack, {}).setdefault(block, {})[f"lora_{target}"] = parts
    return out


def _per_module(saved: dict, field: str, module: str, default):
    """PEFT's rank_pattern or alpha_pattern value for `module` (its name in the base model): the first pattern
    that matches the name's end at a dot (peft.utils.other.get_pattern_key), else `default`."""
    for pattern, value in (saved.get(field) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def peft_config(lora, spec: Architecture, base: str = "") -> dict:
    """adapter_config.json for adapters of `lora` (model.lora's settings) on `spec`'s projections."""
    targets = [t for t in present(spec) if t in lora.targets]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": 0.0, "target_modules": sorted(PROJECTIONS[t][1].split(".")[-1] for t in targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True, "base_model_name_or_path": base}  # fmt: skip


def check_config(saved: dict, lora, where: str, spec: Architecture, modules: str = MODULES) -> None:
    """Refuse a PEFT adapter whose settings are not this config's model.lora (rank, alpha, targets), or that
    holds what our adapters cannot (a rank of its own for some modules, trained modules of its own, biases, ...),
    naming the field."""
    if saved.get("peft_type", "LORA") != "LORA" or saved.get("use_dora") or saved.get("use_rslora"):
        raise ConfigError(f"{where} is not a plain LoRA adapter (peft_type LORA, no DoRA or rsLoRA).")
    modules_to_save = saved.get("modules_to_save")
    if modules_to_save:
        raise ConfigError(
            f"the adapter in {where} was made with modules_to_save={modules_to_save!r}: the adapter "
            f"carries trained {', '.join(modules_to_save)} weights of its own, which model.lora's "
            "adapters cannot hold; merge it into its base with peft (merge_and_unload, then "
            "save_pretrained) and import the merged model with scripts/convert_hf.py import."
        )
    init = saved.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING):
        raise ConfigError(f"the adapter in {where} was made with init_lora_weights={init!r}: PEFT's load rewrites the "
                          "base weights (it subtracts the adapter's initial product from them), which adapters on an "
                          "unchanged base cannot give; save it as plain LoRA with PEFT (save_pretrained with "
                          "path_initial_model_for_weight_conversion) and import that.")  # fmt: skip
    for field, value in saved.items():
        if field not in NEUTRAL and value not in (None, False, "none", {}, [], "") and field != "modules_to_save":
            raise ConfigError(f"the adapter in {where} was made with {field}={value!r}, which changes what the "
                              "adapted model computes and has no form here; only plain LoRA adapters on every "
                              "layer's projections are imported.")  # fmt: skip
    for i in range(spec.n_layers):
        for target in (t for t in present(spec, i) if t in lora.targets):
            module = f"{modules}.{i}.{PROJECTIONS[target][1]}"
            rank = _per_module(saved, "rank_pattern", module, saved.get("r"))
            if rank != saved.get("r"):
                raise ConfigError(f"in the adapter in {where}, rank_pattern gives {module} rank {rank} where "
                                  f"model.lora.rank is {saved.get('r')}; the adapters here give every projection "
                                  "one rank.")  # fmt: skip
    names = saved.get("target_modules") or []
    names = [names] if isinstance(names, str) else sorted(names)
    ours_of = {theirs.split(".")[-1]: ours for ours, (_, theirs) in PROJECTIONS.items()}
    strange = [m for m in names if m not in ours_of]
    if strange:
        raise ConfigError(f"the adapter in {where} adapts {', '.join(strange)} (target_modules), which the adapters "
                          f"here cannot hold; they adapt {', '.join(t for _, t in PROJECTIONS.values())}.")  # fmt: skip
    # The targets in model.lora.targets' own words (q, k, v, o, gate, up, down, ...), in its order, of those
    # this model has.
    made = ",".join(t for t in present(spec) if t in {ours_of[m] for m in names})
    differ = [f"{ours}={theirs!r} (config has {mine!r})" for ours, theirs, mine in (
        ("model.lora.rank", saved.get("r"), lora.rank), ("model.lora.alpha", float(saved.get("lora_alpha", 0)),
        float(lora.alpha)), ("model.lora.targets", made, ",".join(t for t in present(spec) if t in lora.targets)))
        if theirs != mine]  # fmt: skip
    if differ:
        raise ConfigError(f"the adapter in {where} was made with {', '.join(differ)}; set model.lora to match it.")


def write(tensors: dict[str, np.ndarray], lora, spec: Architecture, out_dir: str, base: str = "") -> None:
    """An adapter directory PEFT loads: `to_peft`'s tensors and their adapter_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    hf_files.write_safetensors(tensors, os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(peft_config(lora, spec, base), f, indent=2)


def read(adapter_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory."""
    from safetensors.numpy import load_file

    files = [os.path.join(adapter_dir, name) for name in (CONFIG_FILE, WEIGHTS_FILE)]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        raise ConfigError(f"{adapter_dir} is not a PEFT adapter directory: it has no {os.path.basename(missing[0])}.")
    with open(files[0]) as f:
        return json.load(f), load_file(files[1])
