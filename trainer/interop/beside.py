"""What an import does not read, kept in the run and put back on export: a Hub checkpoint whose language model
sits inside a larger one (Qwen3.5's `Qwen3_5ForConditionalGeneration`: a vision tower beside the text model)
is read by its text model, and every tensor our mapping does not read (that tower; the multi-token prediction
layers, `mtp.*`, of the Hub's Qwen3.5 and Qwen3-Next checkpoints; DeepSeek-V3's MTP layers) is set aside.

An import keeps in <workdir>/hf_beside the source's config.json (whose keys an export writes again,
kept_keys) and the tensors set aside (model.safetensors). A text model whose arithmetic is another family's
too (Qwen3-Next's is Qwen3.5-MoE's) is written as its own class again. An export of that run, or of one
started from it (checkpoint.init_from, a LoRA run's base), writes the source's class again: the text model's
tensors under the source's names and the kept tensors beside them, as float32.
"""

from __future__ import annotations

import json
import os

import numpy as np

from trainer.interop.hf_files import read_config, read_weights, write_weights

# model_type -> (the key of its text model's config, its text model's tensor prefix, the source's class)
FORMS = {
    "qwen3_5": ("text_config", "model.language_model.", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": ("text_config", "model.language_model.", "Qwen3_5MoeForConditionalGeneration"),
}
ASIDE = "hf_beside"
# Text forms whose arithmetic another family's form also is (Qwen3-Next's is Qwen3.5-MoE's): an import keeps
# the source's config, so that an export writes that form again.
REMEMBERED = ("qwen3_next",)


def text_part(config: dict, tensors: dict | None = None) -> tuple[dict, dict | None, dict]:
    """(the text model's config.json, its tensors under the text class's names, the tensors set aside) of a
    checkpoint; a text model's own comes back whole, with nothing aside."""
    form = FORMS.get(config.get("model_type"))
    if form is None:
        return config, tensors, {}
    key, prefix, _ = form
    text = dict(config[key])
    if "tie_word_embeddings" in config:  # the outer model's, which transformers ties by
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    if tensors is None:
        return text, None, {}
    ours = {("model." + k[len(prefix) :]) if k.startswith(prefix) else k: v for k, v in tensors.items()
            if k.startswith(prefix) or k == "lm_head.weight"}  # fmt: skip
    aside = {k: v for k, v in tensors.items() if not (k.startswith(prefix) or k == "lm_head.weight")}
    return text, ours, aside


def source_name(config: dict, name: str) -> str:
    """A text model's tensor name as the checkpoint of `config` names it (text_part's renaming undone)."""
    form = FORMS.get(config.get("model_type"))
    return form[1] + name[len("model.") :] if form and name.startswith("model.") else name


def layers_module(config: dict) -> str:
    """Where a checkpoint's decoder layers sit: the module path a PEFT adapter of it names them by."""
    form = FORMS.get(config.get("model_type"))
    return (form[1] if form else "model.") + "layers"


# What a checkpoint's tensors that no text model of ours reads are, by where their names put them.
PARTS = (("model.visual.", "vision tower"), ("mtp.", "multi-token prediction layers"),
         ("model.mtp.", "multi-token prediction layers"), ("model.audio", "audio tower"))  # fmt: skip


def described(config: dict, aside: dict, text_layers: int) -> str:
    """What an import set aside, in words ("" for nothing): each part by what it is, its tensors and
    parameters. DeepSeek-V3 keeps its multi-token prediction modules as decoder layers past the text model's
    `text_layers`."""
    if not aside:
        return ""
    parts: dict[str, list[str]] = {}
    for name in aside:
        what = next((w for prefix, w in PARTS if name.startswith(prefix)), None)
        if what is None and name.startswith("model.layers.") and int(name.split(".")[2]) >= text_layers:
            what = "multi-token prediction layers"
        parts.setdefault(what or name.rsplit(".", 1)[0], []).append(name)
    said = "; ".join(f"its {what}: {len(names)} tensors, {sum(int(np.prod(aside[n].shape)) for n in names):,} "
                     "parameters" for what, names in parts.items())  # fmt: skip
    kind = FORMS[config["model_type"]][2] if config.get("model_type") in FORMS else config.get("model_type")
    return f"{kind}: what this trainer's model does not read set aside and put back on export ({said})"


def keep(workdir: str, config: dict, aside: dict) -> None:
    """Write the source's config.json, and the tensors an import set aside, into the run."""
    folder = os.path.join(workdir, ASIDE)
    os.makedirs(folder, exist_ok=True)
    if aside:
        write_weights(aside, folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def kept(workdir: str) -> str | None:
    """The folder of what an import set aside for this run: its own, or that of the run it started from."""
    from trainer.training.resume import parse_init_from, saved_config

    seen = set()
    while workdir and workdir not in seen:
        seen.add(workdir)
        folder = os.path.join(workdir, ASIDE)
        if os.path.isdir(folder):
            return folder
        saved = saved_config(workdir)
        workdir = parse_init_from(saved.checkpoint.init_from)[0] if saved and saved.checkpoint.init_from else ""
    return None


def form(folder: str | None) -> str | None:
    """The text form (model_type) an export of a run whose kept folder is `folder` writes, where its family has
    several (REMEMBERED); None: the family's own."""
    kind = text_part(read_config(folder))[0].get("model_type") if folder else None
    return kind if kind in REMEMBERED else None


def put_back(folder: str, text_config: dict, tensors: dict) -> tuple[dict, dict, list[str]]:
    """(the source's config.json with our text model's where it differs (kept_keys), every tensor under the
    source's names, what changed in words)."""
    source = read_config(folder)
    weights = read_weights(folder) if os.path.exists(os.path.join(folder, "model.safetensors")) else {}
    if source.get("model_type") not in FORMS:
        config, changed = kept_keys(source, text_config)
        return config, {**tensors, **weights}, changed
    key, prefix, _ = FORMS[source["model_type"]]
    ours = {k: v for k, v in text_config.items() if k not in ("architectures", "model_type")}
    text, changed = kept_keys({**source[key], "tie_word_embeddings": source.get("tie_word_embeddings")}, ours)
    config = {**source, key: {k: v for k, v in text.items() if k != "tie_word_embeddings"}}
    config["tie_word_embeddings"] = text_config["tie_word_embeddings"]
    return config, {source_name(source, k): v for k, v in tensors.items()} | weights, changed


# What an export's config.json says of its own files, whatever the source said: the class, the weights' dtype
# and layout (DeepSeek's RoPE rows are written in halves, whatever pairs they came in), and the ids of the
# tokenizer written beside them.
FILE_KEYS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "rope_interleave",
             "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip


def kept_keys(source: dict, ours: dict) -> tuple[dict, list[str]]:
    """An export's config.json from the source's (what the import read) and ours (the run's model): every key of
    the source is kept, and ours replaces one only where the source's value would make another model of it
    (trainer/interop/families' model_keys_from_hf of the two differ), which is then said, old and new;
    max_position_embeddings keeps the larger of the two (the run's max_seq_len is how long it trained, not how
    long the model reads). Keys of ours that the source lacks are added."""
    from trainer.interop.families import model_keys_from_hf

    out, changed = {**source, **ours}, []
    model = model_keys_from_hf(out)
    for key, value in ours.items():
        if key not in source or source[key] == value or key in FILE_KEYS:
            continue
        if key == "max_position_embeddings":
            out[key] = max(source[key], value)
            if out[key] != source[key]:
                changed.append(f"{key} {source[key]!r} -> {value!r}")
            continue
        if model_keys_from_hf({**out, key: source[key]}) == model:
            out[key] = source[key]  # reads as the same model: the source's own value stays
        else:
            changed.append(f"{key} {source[key]!r} -> {value!r}")
    return out, changed
