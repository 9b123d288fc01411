"""The Hugging Face families a model imports from and exports to, one module each, over a shared core
(core.py: the config keys they all have, and the walk from our weights to a family's tensors and back).

A family module has:
    CLASSES         {model_type: the transformers class} of the forms it covers (Qwen3's covers Qwen3-MoE)
    LAYOUT          a core.Layout: what its tensors are named and shaped like where the core's defaults differ
    claims(spec)    the model_type it gives our architecture, None if not its, or a sentence (ConfigError)
                    for a model that has its details but cannot take its form
    config(spec, common) -> its config.json, from the keys every family shares (core.common_config)
    model_keys(config)   -> our model.* values for its config.json, refusing what our models lack

Which family a model is follows from its architecture: FAMILIES are asked in order, and the first that
claims it gives its form. Adding a family is a module and its line in FAMILIES (docs/model_families.md).
"""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID
from trainer.interop.families import core, deepseek_v3, gemma3, llama, mistral, mixtral, qwen3, qwen3_5, qwen3_next
from trainer.model.spec import Architecture

FAMILIES = (
    qwen3_5,  # linear-attention layers beside gated full attention
    qwen3_next,  # Qwen3.5-MoE's arithmetic in another layout: claims nothing, written for runs imported from it
    deepseek_v3,  # latent attention
    gemma3,  # Gemma's norms, GeGLU, scaled embeddings; local and global layers
    mistral,  # a window on every layer
    mixtral,  # experts, no query/key norms
    qwen3,  # query/key norms, with or without experts
    llama,  # none of these
)


# Hybrids of linear and full attention that transformers has and no family here reads: named in the refusal.
HYBRIDS_NOT_READ = {"kimi_linear": "Kimi Linear", "olmo_hybrid": "OLMo Hybrid"}


def classes() -> dict[str, str]:
    """{model_type: transformers class} of every form read and written here."""
    return {kind: name for family in reversed(FAMILIES) for kind, name in family.CLASSES.items()}


def family_of(spec: Architecture, kind: str | None = None):
    """(the family's module, the model_type) of this architecture; refuses one no family has. `kind`: a form
    the run was imported from (beside.form), which is written again where the architecture's family is that
    form's (Qwen3-Next's arithmetic is Qwen3.5-MoE's)."""
    if kind is not None:
        for family in FAMILIES:
            if kind in family.CLASSES:
                return family, kind
    if spec.attention_sinks:
        raise ConfigError("model.attention_sinks: none of the Hugging Face families here (gpt-oss's is not among "
                          "them) has attention sinks, so this model has no Hugging Face form.")  # fmt: skip
    for family in FAMILIES:
        kind = family.claims(spec)
        if kind:
            return family, kind
    core.refuse_unclaimed(spec)


def hf_config(spec: Architecture, max_seq_len: int, special: tuple[int, int, int] = (BOS_ID, EOS_ID, PAD_ID),
              kind: str | None = None) -> dict:  # fmt: skip
    """The config.json of this architecture's family (of form `kind`, family_of); `special`: the tokenizer's
    (begin, end, padding) ids."""
    family, kind = family_of(spec, kind)
    return family.config(spec, core.common_config(spec, max_seq_len, kind, family.CLASSES[kind], special))


def model_keys_from_hf(config: dict) -> dict:
    """Our model.* values for a Hugging Face config.json of one of the families."""
    kind = config.get("model_type")
    for family in FAMILIES:
        if kind in family.CLASSES:
            return family.model_keys(config)
    what = f"a hybrid of linear and full attention ({HYBRIDS_NOT_READ[kind]}, " if kind in HYBRIDS_NOT_READ else ""
    raise ConfigError(
        f"this Hugging Face model is {what}of model_type {kind!r}{')' if what else ''}, which this trainer does "
        f"not read; it reads {', '.join(f'{name} ({k})' for k, name in classes().items())}."
    )


def to_hf_tensors(params: dict, spec: Architecture, kind: str | None = None) -> dict:
    family, kind = family_of(spec, kind)
    return core.to_hf_tensors(params, spec, family.LAYOUT, family.CLASSES[kind])


def from_hf_tensors(tensors: dict, spec: Architecture, interleaved: bool = False, kind: str | None = None) -> dict:
    """Our parameters from a family's tensors (of form `kind`); `interleaved`: DeepSeek's RoPE rows in
    interleaved pairs."""
    family, _ = family_of(spec, kind)
    return core.from_hf_tensors(tensors, spec, family.LAYOUT, interleaved)
