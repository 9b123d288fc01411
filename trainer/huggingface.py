"""Weights and tokenizers to and from Hugging Face's Llama format.

Our parameters map one to one onto `LlamaForCausalLM`'s: the attention and MLP
kernels are stored (in, out) here and (out, in) there, heads are folded into
the projection width, and RoPE already uses Hugging Face's half-split layout,
so no permutation is needed. Files are written with safetensors' numpy API:
exporting needs neither torch nor transformers, only `safetensors` and (for the
tokenizer) `tokenizers`, both in the `hf` extra.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
from etils import epath

from trainer.config import flatten
from trainer.data.tokenizers import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, load_tokenizer
from trainer.errors import ConfigError
from trainer.model.spec import Architecture
from trainer.storage import run_tokenizer

WEIGHTS_FILE = "model.safetensors"


def hf_config(spec: Architecture, max_seq_len: int, special: tuple[int, int, int] = (BOS_ID, EOS_ID, PAD_ID)) -> dict:
    """`special`: the tokenizer's (begin, end, padding) ids."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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


def _llama3(spec: Architecture) -> dict:
    r = spec.rope_scaling
    return {"factor": r.factor, "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_len}  # fmt: skip


def model_keys_from_hf(config: dict) -> dict:
    """Our model.* values for a Hugging Face Llama config; refuses what our model does not implement."""
    # RoPE: transformers 5.x writes rope_parameters, 4.x rope_scaling (None or a dict) beside rope_theta.
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "model_type": config.get("model_type") != "llama",
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "rope_scaling": rope_type not in ("default", "llama3"),
    }
    if any(unsupported.values()):
        bad = ", ".join(f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v)
        raise ConfigError(f"this Hugging Face model has {bad}, which this trainer's Llama does not implement.")
    heads = config["num_attention_heads"]
    if config.get("head_dim", config["hidden_size"] // heads) * heads != config["hidden_size"]:
        raise ConfigError("this Hugging Face model's head_dim x heads differs from hidden_size; not supported.")
    theta = rope.get("rope_theta", config.get("rope_theta", 10_000.0))
    scaling = {}
    if rope_type == "llama3":
        scaling = {"rope_scaling.factor": float(rope["factor"]),
                   "rope_scaling.low_freq_factor": float(rope["low_freq_factor"]),
                   "rope_scaling.high_freq_factor": float(rope["high_freq_factor"]),
                   "rope_scaling.original_max_len": int(rope["original_max_position_embeddings"])}  # fmt: skip
    return {
        **scaling,
        "vocab_size": config["vocab_size"],
        "d_model": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "d_ff": config["intermediate_size"],
        "rope_theta": float(theta),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def to_hf_tensors(params: dict, spec: Architecture) -> dict[str, np.ndarray]:
    layers = params["layers"]
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]["scale"]}
    if not spec.tie_embeddings:
        # muP divides our logits by m; Llama has no output multiplier, so the head carries it
        # (muP refuses tied embeddings, so the input table is untouched).
        out["lm_head.weight"] = params["lm_head"].T / spec.width_multiplier
    d = spec.d_model
    for i in range(spec.n_layers):
        a, m = layers["attn"], layers["mlp"]
        prefix = f"model.layers.{i}."
        out[prefix + "self_attn.q_proj.weight"] = a["wq"][i].reshape(d, -1).T
        out[prefix + "self_attn.k_proj.weight"] = a["wk"][i].reshape(d, -1).T
        out[prefix + "self_attn.v_proj.weight"] = a["wv"][i].reshape(d, -1).T
        out[prefix + "self_attn.o_proj.weight"] = a["wo"][i].reshape(-1, d).T
        out[prefix + "mlp.gate_proj.weight"] = m["w_gate"][i].T
        out[prefix + "mlp.up_proj.weight"] = m["w_up"][i].T
        out[prefix + "mlp.down_proj.weight"] = m["w_down"][i].T
        out[prefix + "input_layernorm.weight"] = layers["attn_norm"]["scale"][i]
        out[prefix + "post_attention_layernorm.weight"] = layers["mlp_norm"]["scale"][i]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def from_hf_tensors(t: dict[str, np.ndarray], spec: Architecture) -> dict:
    d, n, k, h = spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim

    def stack(name, fn):
        return np.stack([fn(t[f"model.layers.{i}.{name}"]) for i in range(spec.n_layers)])

    params = {
        "embed": t["model.embed_tokens.weight"],
        "final_norm": {"scale": t["model.norm.weight"]},
        "layers": {
            "attn": {
                "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h)),
                "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(d, k, h)),
                "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(d, k, h)),
                "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d)),
            },
            "mlp": {
                "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
                "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
                "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
            },
            "attn_norm": {"scale": stack("input_layernorm.weight", lambda w: w)},
            "mlp_norm": {"scale": stack("post_attention_layernorm.weight", lambda w: w)},
        },
    }
    if not spec.tie_embeddings:
        params["lm_head"] = t["lm_head.weight"].T * spec.width_multiplier  # undo the export's muP folding
    return _as_float32(params)


def _as_float32(tree):
    if isinstance(tree, dict):
        return {k: _as_float32(v) for k, v in tree.items()}
    return np.ascontiguousarray(tree, np.float32)


def write_weights(tensors: dict[str, np.ndarray], out_dir: str) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})


def read_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as float32 numpy arrays."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"{hf_dir} holds no .safetensors files; give a Hugging Face model directory.")
    tensors = {}
    for path in files:
        # The flax framework reads bfloat16 too, which numpy cannot.
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                tensors[name] = np.asarray(f.get_tensor(name), np.float32)
    return tensors


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"{hf_dir} has no config.json; give a Hugging Face model directory.")
    with open(path) as f:
        return json.load(f)


# ---- tokenizers ----


def write_tokenizer(data_cfg, out_dir: str) -> None:
    """tokenizer.json + tokenizer_config.json that AutoTokenizer loads and that encode exactly as ours do."""
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
        # Ours encode a text's "<s>" as its bytes or pieces, never as the mark: so does the export.
        split_marks = True
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   split_special_tokens=split_marks)  # fmt: skip
    fast.save_pretrained(out_dir)


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


def export_checkpoint(cfg, workdir: str, step: int | None, out_dir: str) -> int:
    """Write a Llama-format directory (config, safetensors, tokenizer) for a checkpoint; returns its step."""
    import jax

    from trainer.storage.resume import load_params

    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ConfigError(f"{out_dir} is not empty; export into a new directory.")
    if jax.process_count() > 1:
        raise ConfigError("export in a single process: it gathers the whole model onto one host anyway.")
    cfg = run_tokenizer.settle(cfg, workdir)  # the run's own copy of its tokenizer
    setup, step, params = load_params(cfg, workdir, step)
    tensors = to_hf_tensors(jax.device_get(params), setup.spec.arch)
    os.makedirs(out_dir, exist_ok=True)
    write_weights(tensors, out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        tok = load_tokenizer(cfg.data)
        special = (tok.bos_id, tok.eos_id, tok.pad_id)
        json.dump(hf_config(setup.spec.arch, cfg.model.max_seq_len, special), f, indent=2)
    write_tokenizer(cfg.data, out_dir)
    return step


def import_checkpoint(hf_dir: str, cfg, workdir: str) -> None:
    """Write the weights of a Hugging Face Llama directory as step 0 of a new run in `workdir`.

    The optimiser state starts fresh and the data from the beginning: train.py
    continues from it, eval.py evaluates it.
    """
    import jax

    from trainer.storage import workdir as wd
    from trainer.storage.checkpoint import Checkpointer
    from trainer.training.setup import build
    from trainer.training.state import param_shardings, state_from_params

    wanted, have = model_keys_from_hf(read_config(hf_dir)), flatten(cfg)
    differ = [f"model.{k}={v!r} (config has {have[f'model.{k}']!r})" for k, v in wanted.items()
              if have[f"model.{k}"] != v]  # fmt: skip
    if differ:
        raise ConfigError(
            f"the Hugging Face model needs {', '.join(differ)}; set these with --config.model.* or use a "
            "config that matches."
        )
    if wd.saved_steps(workdir):
        raise ConfigError(f"{workdir} already holds checkpoints; import into a new --workdir.")
    setup = build(cfg)
    params = from_hf_tensors(read_weights(hf_dir), setup.spec.arch)
    expected = jax.tree.map(lambda a: a.shape, setup.model.abstract_params)
    if jax.tree.map(lambda a: a.shape, params) != expected:
        raise ConfigError(f"the weights in {hf_dir} do not have the shapes its config.json describes.")
    params = jax.device_put(params, param_shardings(setup.model, setup.shard))
    state = state_from_params(params, setup.model, setup.tx, setup.shard, cfg.train.seed, setup.counters)
    wd.check_writable(workdir)
    wd.write_config(workdir, cfg)
    run_tokenizer.store(cfg, workdir)
    ckpt = Checkpointer(wd.checkpoint_dir(workdir), keep=cfg.checkpoint.keep)
    ckpt.save(0, state, None)
    ckpt.wait()
    ckpt.close()
