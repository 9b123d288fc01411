"""Checkpoints and tokenizers to and from Hugging Face's formats (Llama, Mistral, Qwen3, Mixtral, Qwen3-MoE,
Gemma 3, DeepSeek-V3, Qwen3.5: how our weights map onto theirs is trainer/interop/families/; the files
themselves, trainer/interop/hf_files.py).

Files are written with safetensors' numpy API:
exporting needs neither torch nor transformers, only `safetensors` and (for the
tokenizer) `tokenizers`, both in the `hf` extra.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

from etils import epath

from trainer.config.errors import ConfigError
from trainer.config.forms import flatten
from trainer.data import run_tokenizer
from trainer.data.chat import end_of_turn_ids, template_for
from trainer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, load_tokenizer, tokenizer_file
from trainer.interop import beside, peft
from trainer.interop.families import from_hf_tensors, hf_config, model_keys_from_hf, to_hf_tensors
from trainer.interop.hf_files import read_config, read_weights, write_weights
from trainer.model import adapters, quantised
from trainer.model.spec import Adapters, Architecture

# ---- tokenizers ----


def write_tokenizer(data_cfg, out_dir: str) -> None:
    """tokenizer.json + tokenizer_config.json that AutoTokenizer loads and that encode exactly as ours do."""
    hf_tokenizer(data_cfg).save_pretrained(out_dir)


def write_generation_config(data_cfg, out_dir: str) -> None:
    """generation_config.json: transformers' generate stops where ours does, at the end of a document and, for
    a chat model, at its template's end of turn (ChatML's <|im_end|>), which is not the tokenizer's eos."""
    tok = load_tokenizer(data_cfg)
    stops = [tok.eos_id]
    if getattr(data_cfg, "format", "text") != "text":
        stops += sorted(end_of_turn_ids(tok, template_for(data_cfg, tok)) - {tok.eos_id})
    config = {"bos_token_id": tok.bos_id, "eos_token_id": stops if len(stops) > 1 else stops[0],
              "pad_token_id": tok.pad_id}  # fmt: skip
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def hf_tokenizer(data_cfg):
    """Our tokenizer as a transformers PreTrainedTokenizerFast (built, nothing written)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    # Training fed the model BOS and then the text's tokens, nothing after: the export's post-processor adds
    # exactly that. A user's file may have none (most BPE files), add BOS already, or BOS and EOS; the
    # template replaces it (a byte-level post-processor only trims offsets, which change no id).
    if data_cfg.tokenizer == "hf":  # the user's own file, with its own marks
        ours = load_tokenizer(data_cfg)
        tok = Tokenizer.from_str(epath.Path(ours.file).read_text())
        bos, eos = tok.id_to_token(ours.bos_id), tok.id_to_token(ours.eos_id)
        pad = tok.id_to_token(ours.pad_id)
        # The text's own spelling of a mark is the mark, in training (tokenizers' encode) as here.
        split_marks = False
    else:
        if data_cfg.tokenizer == "byte":
            tok = _byte_level_tokenizer(Tokenizer, models, decoders)
        else:
            tok = _sentencepiece_tokenizer(data_cfg.tokenizer_path, Tokenizer, models, decoders, normalizers)
        bos, eos, pad = "<s>", "</s>", "<pad>"
        # Ours encode a text's "<s>" as its bytes or pieces, never as the mark: so does the export. A chat
        # template's rendering spells its marks (trainer/data/chat.py), so a conversational run's export reads
        # them as marks.
        split_marks = getattr(data_cfg, "format", "text") == "text"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                  split_special_tokens=split_marks)  # fmt: skip
    if getattr(data_cfg, "format", "text") != "text":  # the exported model chats through the template it learnt
        out.chat_template = template_for(data_cfg, load_tokenizer(data_cfg)).source
    return out


def _byte_level_tokenizer(Tokenizer, models, decoders):
    from tokenizers import pre_tokenizers

    # GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer speaks.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    offset = ByteTokenizer.offset
    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, **{chars[b]: b + offset for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(path, Tokenizer, models, decoders, normalizers):
    """SentencePiece BPE as a `tokenizers` pipeline: '▁' for spaces plus a leading one, as our training does."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=epath.Path(path).expanduser().read_bytes())
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=bpe_merges(vocab), byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def bpe_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges that rebuild every piece from two others, in the order SentencePiece learnt the pieces."""
    merges = []
    for piece, rank in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], (left, right)))
    return [m[-1] for m in sorted(merges)]


# ---- whole workdirs ----


def export_checkpoint(cfg, workdir: str, step: int | None, out_dir: str, adapter: bool = False,
                      say: Callable[[str], None] = lambda _: None) -> int:  # fmt: skip
    """Write a Hugging Face directory (config, safetensors, tokenizer) for a checkpoint; returns its step. A
    LoRA run's (model.lora) is its base with the adapters merged in; with `adapter`, its adapters alone as a
    PEFT adapter directory (trainer/interop/peft.py), which loads on the export of its base. A run imported
    from Hugging Face writes the source's config.json keys again; `say` hears each that the run changed.

    Everything that can refuse (the directory, the model's form, the weights, the tokenizer) is settled before
    the first byte is written, so a refused export leaves nothing behind and the same command can be rerun."""
    import jax

    from trainer.training.resume import load_params

    require_hf_extra()
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir} is not empty; export into a new directory.")
    if jax.process_count() > 1:
        raise ConfigError("export in a single process: it gathers the whole model onto one host anyway.")
    cfg = run_tokenizer.settle(cfg, workdir)  # the run's own copy of its tokenizer
    tok = load_tokenizer(cfg.data)
    special = (tok.bos_id, tok.eos_id, tok.pad_id)
    lora, arch = cfg.model.lora, dataclasses.replace(Architecture.from_config(cfg), lora=Adapters())
    if adapter and not lora.rank:
        raise ConfigError("export --adapter: this run trains no adapters (model.lora.rank=0); export it whole.")
    source = beside.kept(workdir)  # what an import set aside, or the form it came in
    fused = [t for t in ("qkv", "z") if lora.rank and t in lora.targets and "linear_attention" in arch.layer_types]
    if adapter and fused and beside.form(source) == "qwen3_next":
        raise ConfigError(f"export --adapter: adapters on {','.join(fused)} have no PEFT form on Qwen3-Next, "
                          "whose q, k, v and z come from one projection (in_proj_qkvz); export the merged model "
                          "with --out, or train with model.lora.targets without qkv and z.")  # fmt: skip
    config = hf_config(arch, cfg.model.max_seq_len, special, beside.form(source))  # before the restore
    setup, step, params = load_params(cfg, workdir, step)
    params = jax.device_get(params)
    tokenizer = hf_tokenizer(cfg.data)
    if adapter:  # with the run's tokenizer: its chat template is the fine-tune's, not the base's
        modules = beside.layers_module(read_config(source)) if source else peft.MODULES  # the base's export's
        tensors = peft.to_peft(adapters.split(params)[0], arch, modules)  # what can refuse, before anything is written
        peft.write(tensors, lora, arch, out_dir)  # on a run of ours, which peft cannot load (convert_hf.py says)
        tokenizer.save_pretrained(out_dir)
        return step
    if lora.rank:  # the model the adapters make, as plain weights (a QLoRA base as the run saw it, dequantised)
        params = jax.device_get(adapters.fold(quantised.dequantised(params), lora.alpha / lora.rank))
    tensors = to_hf_tensors(params, arch, beside.form(source))
    if source is not None:  # imported: the source's keys, and a larger model's form and tensors, put back
        config, tensors, changed = beside.put_back(source, config, tensors)
        for change in changed:
            say(f"config.json: {change} (the run's model differs from the imported one there)")
    os.makedirs(out_dir, exist_ok=True)
    write_weights(tensors, out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    write_generation_config(cfg.data, out_dir)
    return step


def require_hf_extra() -> None:
    """What convert_hf.py needs beyond the trainer's own dependencies, asked for before anything is read."""
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"converting to or from Hugging Face's formats needs the hf extra ({e.name} is not "
                          'installed): pip install -e ".[hf]".') from e  # fmt: skip


def import_checkpoint(hf_dir: str, cfg, workdir: str, adapter_dir: str | None = None) -> str:
    """Write the weights of a Hugging Face directory (a family of trainer/interop/families/) as step 0 of a new
    run in `workdir`.

    The optimiser state starts fresh and the data from the beginning: train.py
    continues from it, eval.py evaluates it. With `adapter_dir`, a PEFT adapter trained on that model: the
    model goes to <workdir>/base, and `workdir` becomes step 0 of a LoRA run (model.lora, as the adapter was
    made) on it, its adapters the adapter's. Everything that can refuse does so before anything is written.
    A larger model's text model (trainer/interop/beside.py) is read alone, the rest kept beside it. Returns
    what was set aside, in words ("" for nothing).
    """
    import jax

    from trainer.config.forms import with_changes
    from trainer.training.setup import build
    from trainer.training.state import param_shardings, state_from_params, trained

    require_hf_extra()
    cfg = _as_imported(cfg, hf_dir)
    lora = cfg.model.lora
    if adapter_dir is None:
        if lora.rank:
            raise ConfigError("import: model.lora.rank > 0 is a run of adapters; give them with --adapter DIR (a "
                              "PEFT adapter), or import the model alone with --config.model.lora.rank=0.")  # fmt: skip
        state, aside = _imported_state(hf_dir, cfg, workdir)
        _write(cfg, workdir, state)
        return _keep(hf_dir, workdir, aside, cfg.model.n_layers)
    if not lora.rank:
        raise ConfigError("import --adapter: set model.lora.rank, alpha and targets as the adapter was trained.")
    saved, tensors = peft.read(adapter_dir)
    modules = beside.layers_module(read_config(hf_dir))
    peft.check_config(saved, lora, adapter_dir, Architecture.from_config(cfg), modules)
    base_dir = os.path.join(workdir, "base")
    base_cfg = with_changes(cfg, {"model.lora.rank": 0, "checkpoint.init_from": ""})
    cfg = with_changes(cfg, {"checkpoint.init_from": f"{base_dir}@0"})
    base_state, aside = _imported_state(hf_dir, base_cfg, base_dir)
    _refuse_checkpoints(workdir)
    setup = build(cfg)
    added = peft.from_peft(tensors, trained(setup.model.abstract_params, setup.model), setup.spec.arch, saved,
                           modules)  # fmt: skip
    added = jax.device_put(added, trained(param_shardings(setup.model, setup.shard), setup.model))
    state = state_from_params(added, setup.model, setup.tx, setup.shard, cfg.train.seed, setup.counters)
    _write(base_cfg, base_dir, base_state)
    _write(cfg, workdir, state)
    return _keep(hf_dir, base_dir, aside, cfg.model.n_layers)


def _keep(hf_dir: str, workdir: str, aside: dict, text_layers: int) -> str:
    beside.keep(workdir, read_config(hf_dir), aside)  # its config.json always: the export keeps its keys
    return beside.described(read_config(hf_dir), aside, text_layers)


def _as_imported(cfg, hf_dir: str):
    """The config an import's run keeps: the model folder's own tokenizer (and so its chat template), where the
    folder has one, for a model reads only the ids it was trained on; and no checkpoint.init_from, which named
    another model's weights (a recipe's base run)."""
    from trainer.config.forms import with_changes

    changes = {"checkpoint.init_from": ""}
    theirs = os.path.join(hf_dir, "tokenizer.json")
    if os.path.isfile(theirs) and not _ours_exported(cfg.data, theirs):
        d = cfg.data
        if d.tokenizer == "hf" and d.tokenizer_path:
            if not _same_tokenizer(tokenizer_file("hf", d.tokenizer_path), theirs):
                raise ConfigError(f"data.tokenizer_path={d.tokenizer_path!r} is another tokenizer than the "
                                  f"model's own ({theirs}); leave data.tokenizer_path out to read with the "
                                  "model's, or import a model trained with that one.")  # fmt: skip
        changes.update({"data.tokenizer": "hf", "data.tokenizer_path": os.path.abspath(hf_dir)})
    return with_changes(cfg, changes)


def _same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer.json files read text as the same ids: the same model, vocabulary, added tokens,
    normalizer and pre-tokenizer, however each file was written (an export writes the run's tokenizer out again
    through transformers, which reorders and adds keys that do not change an id)."""

    def reads(path: str) -> dict:
        with open(path) as f:
            t = json.load(f)
        added = sorted((x["id"], x["content"], x.get("special")) for x in t.get("added_tokens") or [])
        return {"model": t.get("model"), "added": added, "normalizer": t.get("normalizer"),
                "pre_tokenizer": t.get("pre_tokenizer")}  # fmt: skip

    return reads(a) == reads(b)


def _ours_exported(data_cfg, file: str) -> bool:
    """Whether a folder's tokenizer.json is the config's byte or SentencePiece tokenizer as an export writes it
    (a model of ours coming back): then the config's own reads the same ids, and stays."""
    if data_cfg.tokenizer == "hf":
        return False
    from tokenizers import Tokenizer

    try:
        ours = hf_tokenizer(data_cfg).backend_tokenizer.to_str()
    except (ConfigError, OSError):  # a SentencePiece model not at its path: not this config's tokenizer then
        return False
    return Tokenizer.from_str(ours).to_str() == Tokenizer.from_file(file).to_str()


def _refuse_checkpoints(workdir: str) -> None:
    from trainer.storage import workdir as wd

    if wd.saved_steps(workdir):
        raise ConfigError(f"{workdir} already holds checkpoints; import into a new --workdir.")


def _imported_state(hf_dir: str, cfg, workdir: str):
    """(step 0's state from a Hugging Face directory's weights, once they are known to fit the config; the
    tensors that are not its text model's)."""
    import jax

    from trainer.training.setup import build
    from trainer.training.state import param_shardings, state_from_params

    wanted, have = model_keys_from_hf(beside.text_part(read_config(hf_dir))[0]), flatten(cfg)
    have["model.head_dim"] = Architecture.from_config(cfg).head_dim  # its 0 means d_model / n_heads
    differ = [f"model.{k}={v!r} (config has {have[f'model.{k}']!r})" for k, v in wanted.items()
              if have[f"model.{k}"] != v]  # fmt: skip
    if differ:
        raise ConfigError(
            f"the Hugging Face model needs {', '.join(differ)}; set these with --config.model.* or use a "
            "config that matches."
        )
    _refuse_checkpoints(workdir)
    setup = build(cfg)
    interleaved = bool(read_config(hf_dir).get("rope_interleave"))  # DeepSeek's RoPE pairs
    source = read_config(hf_dir)
    text, tensors, aside = beside.text_part(source, read_weights(hf_dir))
    params = from_hf_tensors(tensors, setup.spec.arch, interleaved, text.get("model_type"))
    # What the mapping read is what it writes back; every other tensor (a text model's multi-token prediction
    # layers, which no family here reads) is set aside with the rest, and put back on export.
    read = set(to_hf_tensors(params, setup.spec.arch, text.get("model_type")))
    aside |= {beside.source_name(source, k): v for k, v in tensors.items() if k not in read}
    if setup.spec.arch.mtp.depth:  # no family here holds multi-token prediction modules: they start fresh
        params["mtp"] = jax.device_get(setup.new_state().params["mtp"])
    expected = jax.tree.map(lambda a: a.shape, setup.model.abstract_params)
    if jax.tree.map(lambda a: a.shape, params) != expected:
        raise ConfigError(f"the weights in {hf_dir} do not have the shapes its config.json describes.")
    params = jax.device_put(params, param_shardings(setup.model, setup.shard))
    return state_from_params(params, setup.model, setup.tx, setup.shard, cfg.train.seed, setup.counters), aside


def _write(cfg, workdir: str, state) -> None:
    from trainer.storage import workdir as wd
    from trainer.storage.checkpoint import Checkpointer

    wd.check_writable(workdir)
    wd.write_config(workdir, cfg)
    run_tokenizer.store(cfg, workdir)
    ckpt = Checkpointer(wd.checkpoint_dir(workdir), keep=cfg.checkpoint.keep)
    ckpt.save(0, state, None)
    ckpt.wait()
    ckpt.close()
