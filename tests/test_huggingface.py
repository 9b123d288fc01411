"""Interop with transformers (Llama, Mixtral and Qwen3-MoE models, AutoTokenizer), in both directions."""

import contextlib
import io
import json
import os
import re
import sysconfig

import jax
import numpy as np
import pytest
from conftest import micro_config

torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")

from trainer.config.errors import ConfigError  # noqa: E402
from trainer.data.tokenizers import BOS_ID, ByteTokenizer, SentencePieceTokenizer, train_sentencepiece  # noqa: E402
from trainer.evaluation.loss import evaluate_checkpoint  # noqa: E402
from trainer.interop import beside  # noqa: E402
from trainer.interop.huggingface import export_checkpoint, import_checkpoint, write_tokenizer  # noqa: E402
from trainer.model.sampling import make_generate  # noqa: E402
from trainer.run.loop import train  # noqa: E402
from trainer.training.resume import load_params  # noqa: E402
from trainer.training.setup import build  # noqa: E402

TOKENS = np.random.default_rng(0).integers(3, 384, (2, 24))


def hf_logits(model_dir_or_model):
    model = model_dir_or_model
    if isinstance(model, str):
        model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def round_trip(model, cfg, tmp_path, prompt: int = 6, new: int = 8, extra: dict | None = None, aside: str = ""):
    """A transformers `model` saved, imported under `cfg`: our logits are its, our greedy continuation of
    `prompt` tokens its `generate`'s, and our export loads back into transformers with the same logits.
    `extra`: tensors added to the saved checkpoint (as the Hub's carry multi-token prediction layers that
    transformers does not load), which the import says it set aside (`aside`) and the export puts back
    exactly. Returns (setup, params) of the import."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(str(tmp_path / "hf"))
    if extra:
        file = str(tmp_path / "hf" / "model.safetensors")
        save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    workdir = str(tmp_path / "run")
    assert import_checkpoint(str(tmp_path / "hf"), cfg, workdir) == aside
    if extra:
        exported_later = lambda: load_file(str(tmp_path / "out" / "model.safetensors"))  # noqa: E731
    logits = our_logits(cfg, workdir)
    np.testing.assert_allclose(logits, hf_logits(model), rtol=1e-4, atol=1e-4)
    setup, _, params = load_params(cfg, workdir)
    ours = np.asarray(make_generate(setup.spec, setup.shard, max_new_tokens=new)(params, TOKENS[:, :prompt], 0))
    with torch.no_grad():
        theirs = model.generate(torch.tensor(TOKENS[:, :prompt]), max_new_tokens=new, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[:, prompt:].numpy()  # fmt: skip
    np.testing.assert_array_equal(ours, theirs)
    said = []
    assert export_checkpoint(cfg, workdir, None, str(tmp_path / "out"), say=said.append) == 0
    np.testing.assert_allclose(hf_logits(str(tmp_path / "out")), logits, rtol=1e-4, atol=1e-4)
    # The export keeps every key of the source's config.json, but those that describe its own files.
    source, exported = (json.load(open(tmp_path / d / "config.json")) for d in ("hf", "out"))
    kept = {k: v for k, v in source.items() if k not in beside.FILE_KEYS}
    assert {k: exported.get(k, "missing") for k in kept} == kept and said == []
    if extra:
        back = exported_later()
        for name, tensor in extra.items():
            np.testing.assert_array_equal(back[name], tensor, err_msg=name)
    return setup, params


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def our_logits(cfg, workdir):
    setup, _, params = load_params(cfg, workdir)
    return np.asarray(jax.jit(setup.model.apply)(params, TOKENS))


@pytest.mark.parametrize(
    "model",
    [dict(tie_embeddings=False), dict(tie_embeddings=True), dict(mup_base_width=16), dict(sliding_window=8)],
    ids=["untied", "tied", "mup", "mistral"],
)
def test_exported_checkpoint_gives_transformers_our_logits(tmp_path, model):
    """muP divides our logits by m = d_model / base width (4 here); the exported head carries it. A window on
    every layer exports as Mistral (24 tokens over a window of 8)."""
    cfg = micro_config(model=model, train=dict(steps=3))
    workdir = str(tmp_path / "run")
    train(cfg, workdir)  # trained a little, so the weights are not just their initialisation
    out = str(tmp_path / "hf")
    assert export_checkpoint(cfg, workdir, None, out) == 3
    modes = {name: oct(os.stat(os.path.join(out, name)).st_mode & 0o777) for name in os.listdir(out)}
    assert set(modes.values()) == {oct(0o666 & ~umask())}, modes  # the weights as readable as the rest
    np.testing.assert_allclose(hf_logits(out), our_logits(cfg, workdir), rtol=1e-4, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n\treturn  x  # ünïcode ✓"
    assert tokenizer(text)["input_ids"] == [BOS_ID, *ByteTokenizer().encode(text).tolist()]
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    if model == dict(tie_embeddings=False):  # docs/huggingface.md's load-and-generate block, run on this export
        page = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "huggingface.md")).read()
        (block,) = re.findall(r"```python\n(.*?)```", page, re.S)
        assert 'out = "hf/tiny"' in block
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(block.replace('out = "hf/tiny"', f"out = {out!r}"), {})
        assert printed.getvalue().startswith("def main(") and len(printed.getvalue()) > len("def main(\n")
        # scripts/score.py's figures are transformers' log-probabilities on the export, position for position.
        from trainer.evaluation.logprobs import score_text

        scored = score_text(cfg, workdir, None, text, top=3)
        with torch.no_grad():
            theirs = torch.log_softmax(transformers.AutoModelForCausalLM.from_pretrained(out)(
                torch.tensor([scored["tokens"]])).logits[0].double(), -1).numpy()  # fmt: skip
        ids = scored["tokens"]
        np.testing.assert_allclose(scored["logprobs"], theirs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
        assert [t for t, _ in scored["top"][0]] == np.argsort(-theirs[0])[:3].tolist()


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_model_imports_and_trains_on(tmp_path, tied):
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10_000.0,
        tie_word_embeddings=tied, initializer_range=0.2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(str(tmp_path / "hf"))
    cfg = micro_config(model=dict(tie_embeddings=tied, norm_eps=1e-5), train=dict(steps=2))
    workdir = str(tmp_path / "run")
    import_checkpoint(str(tmp_path / "hf"), cfg, workdir)
    np.testing.assert_allclose(our_logits(cfg, workdir), hf_logits(model), rtol=1e-4, atol=1e-5)
    assert train(cfg, workdir)["step"] == 2  # continues from step 0
    assert evaluate_checkpoint(cfg, workdir, max_batches=1)["step"] == 2


def test_an_import_reads_with_the_models_own_tokenizer_and_starts_from_nothing_else(tmp_path):
    """A Llama with its own tokenizer.json, imported under a recipe made for another model (byte tokens, a chat
    format, init_from a run of ours, as configs/sft_tiny.py): the run keeps the folder's tokenizer, so training
    feeds that model its own ids, and no init_from; a config naming another tokenizer file is one sentence."""
    from trainer.data.tokenizers import load_tokenizer
    from trainer.training.resume import saved_config

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False))  # fmt: skip
    model.save_pretrained(str(tmp_path / "hf"))
    hf_tok = llama3_style_tokenizer(tmp_path / "hf_tok")
    hf_tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    data = dict(source="text_files", format="chat", loss_on="assistant", tokenizer="byte",
                paths="runs/chat_data/sft/*.jsonl")  # fmt: skip
    cfg = micro_config(model=dict(norm_eps=1e-5), data=data, checkpoint={"init_from": "runs/quickstart"})
    import_checkpoint(str(tmp_path / "hf"), cfg, str(tmp_path / "run"))
    saved = saved_config(str(tmp_path / "run"))
    assert (saved.data.tokenizer, saved.checkpoint.init_from) == ("hf", "")
    text = "def f(x):\n    return x"
    assert load_tokenizer(saved.data).encode(text).tolist() == hf_tok.encode(text).ids
    other = micro_config(model=dict(norm_eps=1e-5), data=dict(tokenizer="hf", tokenizer_path=str(tmp_path / "tok")))
    llama3_style_tokenizer(tmp_path / "tok")
    other_tok = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())  # two tokens' ids swapped
    (a, i), (b, j) = list(other_tok["model"]["vocab"].items())[10:12]
    other_tok["model"]["vocab"].update({a: j, b: i})
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(other_tok))
    with pytest.raises(ConfigError, match=r"data.tokenizer_path=.*/tok' is another tokenizer than the model's own "
                                          r"\(.*/hf/tokenizer.json\)"):  # fmt: skip
        import_checkpoint(str(tmp_path / "hf"), other, str(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()


# Llama 3's (low/high factors 1 and 4), and YaRN's as gpt-oss and OLMo 3 give it (its ramp untruncated, cos and
# sin times 0.1 ln 4 + 1), each at factor 4 over an original length of 32.
SCALINGS = {
    "llama3": ({"low_freq_factor": 1.0, "high_freq_factor": 4.0}, dict(low_freq_factor=1.0, high_freq_factor=4.0)),
    "yarn": ({"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
             dict(kind="yarn", beta_fast=32.0, beta_slow=1.0, truncate=False)),
}  # fmt: skip


@pytest.mark.parametrize("kind", SCALINGS)
def test_rope_scaling_imports_and_exports_with_transformers_logits(tmp_path, kind):
    """RoPE's frequency scaling for long context (factor 4, original length 32): with head_dim 16 Llama 3's keeps
    the first pair's wavelength (6.3), blends the second's (19.9) and stretches the rest 4x; YaRN's ramps by
    turns over the original length. Built by transformers, imported, exported again, and loaded back."""
    torch.manual_seed(0)
    theirs, ours_keys = SCALINGS[kind]
    scaling = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 32, **theirs}
    hf_config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
        rope_parameters={"rope_theta": 10_000.0, **scaling},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(str(tmp_path / "hf"))
    rope = dict(factor=4.0, original_max_len=32, **ours_keys)
    with pytest.raises(ConfigError, match=r"model.rope_scaling.factor=4.0 \(config has 1.0\)"):
        import_checkpoint(str(tmp_path / "hf"), micro_config(model=dict(norm_eps=1e-5)), str(tmp_path / "no"))
    cfg = micro_config(model=dict(norm_eps=1e-5, rope_scaling=rope))
    workdir = str(tmp_path / "run")
    import_checkpoint(str(tmp_path / "hf"), cfg, workdir)
    ours = our_logits(cfg, workdir)
    np.testing.assert_allclose(ours, hf_logits(model), rtol=1e-4, atol=1e-5)
    unscaled = micro_config(model=dict(norm_eps=1e-5))
    setup, _, params = load_params(cfg, workdir)
    plain = np.asarray(jax.jit(build(unscaled).model.apply)(params, TOKENS))
    assert np.abs(plain - ours).max() > 1e-2  # the scaling changes the function: the test can fail
    assert export_checkpoint(cfg, workdir, None, str(tmp_path / "out")) == 0
    np.testing.assert_allclose(hf_logits(str(tmp_path / "out")), ours, rtol=1e-4, atol=1e-5)


def test_import_refuses_a_config_that_describes_another_model(tmp_path):
    hf_config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    transformers.LlamaForCausalLM(hf_config).save_pretrained(str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=4 \(config has 2\), model.d_ff=96 \(config has 128\)"):
        import_checkpoint(str(tmp_path / "hf"), micro_config(), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_sentencepiece_tokenizer_exports_with_identical_encodings(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    json_dir = os.path.join(stdlib, "json")
    texts = [open(os.path.join(json_dir, f)).read() for f in sorted(os.listdir(json_dir)) if f.endswith(".py")]
    path = str(tmp_path / "spm.model")
    train_sentencepiece(texts, 500, path)
    cfg = micro_config(data=dict(tokenizer="sentencepiece", tokenizer_path=path))
    write_tokenizer(cfg.data, str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = SentencePieceTokenizer(path)
    samples = [open(os.path.join(stdlib, f)).read() for f in ("abc.py", "this.py", "keyword.py", "glob.py")]
    samples += ["  leading spaces", "", " ", "x\n\n\ty  ", "ünïcode ✓ 🐍", "<s> and </s>"]
    for text in samples:
        ids = theirs(text)["input_ids"]
        assert ids == [BOS_ID, *ours.encode(text).tolist()], text[:40]
        assert theirs.decode(ids, skip_special_tokens=True) == text


def llama3_style_tokenizer(directory):
    """A small byte-level BPE with Llama 3's document marks, trained here on the standard library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    marks = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=marks,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    stdlib = sysconfig.get_paths()["stdlib"]
    tok.train([os.path.join(stdlib, name) for name in ("os.py", "json/__init__.py")], trainer)
    os.makedirs(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return tok


def test_a_hugging_face_tokenizer_json_trains_exports_and_marks_documents_with_its_own_tokens(tmp_path):
    hf_tok = llama3_style_tokenizer(tmp_path / "tok")
    (tmp_path / "corpus").mkdir()
    for i in range(60):  # short documents: the stream tokenises on the fly, and this BPE is tiny
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}  # ünïcode ✓\n")
    data = dict(source="text_files", name="short", paths=f"{tmp_path}/corpus/*.txt", data_dir=str(tmp_path / "tfds"),
                tokenizer="hf", tokenizer_path=str(tmp_path / "tok"))  # fmt: skip
    cfg = micro_config(data=data, train=dict(steps=3))
    from trainer.data import corpora, streams
    from trainer.data.tokenizers import load_tokenizer

    ours = load_tokenizer(cfg.data)
    bos, eos = hf_tok.token_to_id("<|begin_of_text|>"), hf_tok.token_to_id("<|end_of_text|>")
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (bos, eos, hf_tok.get_vocab_size())
    text = "def f(x):\n\treturn  x  # ünïcode ✓"
    ids = ours.encode(text)
    assert ids.tolist() == hf_tok.encode(text).ids and ours.decode(ids) == text
    assert ours.token_bytes()[ids].sum() == len(text.encode())  # bits per byte count every byte once
    corpora.prepare(cfg.data)
    stream = streams.Stream.from_config(cfg)
    source = corpora.open_split(cfg.data, "train")
    (doc,) = streams.documents(stream, "train", shuffle=False, endless=False)[:1]
    expected = hf_tok.encode(source[0]["text"].decode()).ids
    assert doc["tokens"].tolist() == [bos, *expected, eos]

    workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    train(cfg, workdir)
    export_checkpoint(cfg, workdir, None, out)
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id) == (bos, eos)
    # The export imported again with its run's own config.json (its tokenizer_path the same tokenizer, which the
    # export wrote out again in transformers' form): read as the same tokens, not refused as another.
    from trainer.config.forms import from_dict

    with open(os.path.join(workdir, "config.json")) as f:
        import_checkpoint(out, from_dict(json.load(f)), str(tmp_path / "again"))

    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"does not load as a Hugging Face tokenizer.json"):
        load_tokenizer(micro_config(data=dict(tokenizer="hf", tokenizer_path=str(tmp_path / "bad.json"))).data)


def test_a_tokenizer_json_without_a_decoder_trains_and_decodes_as_its_file_does(tmp_path):
    """A BPE built with the tokenizers library and no decoder set ("decoder": null in its file): it loads,
    trains, and decodes as the library decodes that file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainer.data.tokenizers import load_tokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([os.path.join(sysconfig.get_paths()["stdlib"], "os.py")],
              trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))  # fmt: skip
    os.makedirs(tmp_path / "tok")
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert '"decoder":null' in (tmp_path / "tok" / "tokenizer.json").read_text().replace(" ", "")
    (tmp_path / "corpus").mkdir()
    for i in range(60):
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"def f{i}(x): return x * {i}\n")
    cfg = micro_config(data=dict(source="text_files", name="plain", paths=f"{tmp_path}/corpus/*.txt",
                                 data_dir=str(tmp_path / "tfds"), tokenizer="hf", tokenizer_path=str(tmp_path / "tok")),
                       train=dict(steps=2))  # fmt: skip
    ours = load_tokenizer(cfg.data)
    ids = ours.encode("def f(x): return x")
    assert ids.tolist() == tok.encode("def f(x): return x").ids and ours.decode(ids) == tok.decode(ids.tolist())
    assert (ours.bos_id, ours.eos_id) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    assert train(cfg, str(tmp_path / "run"))["step"] == 2


@pytest.mark.parametrize("post_processor", ["none", "adds BOS", "adds BOS and EOS", "byte-level offsets"])
def test_an_exported_hf_tokenizer_encodes_as_training_fed_the_model(tmp_path, post_processor):
    """Whatever the user's tokenizer.json does after encoding, AutoTokenizer on the export gives the ids the
    loader feeds the model for a text: one BOS, then the text's tokens; and decodes back to the text."""
    from tokenizers import processors

    from trainer.data.tokenizers import load_tokenizer

    tok = llama3_style_tokenizer(tmp_path / "trained")
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    ids = {m: tok.token_to_id(m) for m in (bos, eos)}
    tok.post_processor = {
        "none": None,
        "adds BOS": processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids[bos])]),
        "adds BOS and EOS": processors.TemplateProcessing(single=f"{bos} $A {eos}", special_tokens=list(ids.items())),
        "byte-level offsets": processors.ByteLevel(trim_offsets=True),
    }[post_processor]
    os.makedirs(tmp_path / "tok")
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert (tok.post_processor is None) == (post_processor == "none")
    data = micro_config(data=dict(tokenizer="hf", tokenizer_path=str(tmp_path / "tok"))).data
    write_tokenizer(data, str(tmp_path / "hf"))
    exported, ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")), load_tokenizer(data)
    for text in ["def f", "def f(x):\n\treturn  x  # ünïcode ✓", "", "  leading", bos]:
        got = exported(text).input_ids
        assert got == [ours.bos_id, *ours.encode(text).tolist()], text
        if text != bos:  # a text spelling a mark decodes without it, as every special token does
            assert exported.decode(got, skip_special_tokens=True) == text


def test_exported_byte_tokenizer_encodes_as_training_fed_the_model(tmp_path):
    write_tokenizer(micro_config().data, str(tmp_path / "hf"))
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    for text in ["def f", "x\n\n\ty  ", "", "ünïcode ✓ 🐍", "<s>"]:
        got = exported(text).input_ids
        assert got == [BOS_ID, *ByteTokenizer().encode(text).tolist()], text
        assert exported.decode(got, skip_special_tokens=True) == text


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_imports_from_transformers_decodes_as_it_does_and_exports_back(tmp_path, kind):
    """Mixtral (every layer 8 experts, top 2) and Qwen3-MoE (query/key norms, 4 layers: the first two dense,
    then experts in every second, decoder_sparse_step 2; heads 32 wide, so 4 heads make 128 for a width of
    64, as Qwen3's released checkpoints differ), built small and random by transformers: our
    logits are theirs, our greedy continuation theirs, and the exported directory loads back into
    transformers with the same logits."""
    torch.manual_seed(0)
    shape = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, num_experts_per_tok=2,
                 tie_word_embeddings=False)  # fmt: skip
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, intermediate_size=32,
                                                                           num_local_experts=8))  # fmt: skip
        ours = dict(d_ff=32, moe=dict(num_experts=8, experts_per_token=2, d_ff=32))
    else:
        config = transformers.Qwen3MoeConfig(**{**shape, "num_hidden_layers": 4}, head_dim=32, intermediate_size=128,
                                             moe_intermediate_size=32, num_experts=8, norm_topk_prob=True,
                                             mlp_only_layers=[0, 1], decoder_sparse_step=2)  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(config)
        ours = dict(qk_norm=True, n_layers=4, head_dim=32,
                    moe=dict(num_experts=8, experts_per_token=2, d_ff=32, dense_layers=2, every=2))  # fmt: skip
    cfg = micro_config(model=dict(norm_eps=1e-5, rope_theta=model.config.rope_parameters["rope_theta"], **ours))
    round_trip(model, cfg, tmp_path)


def test_an_export_with_no_hugging_face_form_writes_nothing(tmp_path):
    """An MoE model with a dense layer between MoE ones and no qk_norm (Qwen3-MoE's form needs it; Mixtral's has
    experts in every layer): refused in one sentence before the first byte, so the same command can be run
    again into the same directory once the model is right."""
    cfg = micro_config(model=dict(n_layers=2, moe=dict(num_experts=4, every=2)), train=dict(steps=2),
                       checkpoint={"every_steps": 2})  # fmt: skip
    workdir, out = str(tmp_path / "run"), tmp_path / "hf"
    train(cfg, workdir)
    with pytest.raises(ConfigError, match="every=2: every Mixtral layer has experts") as info:
        export_checkpoint(cfg, workdir, None, str(out))
    assert "\n" not in str(info.value) and not out.exists()


def test_gemma3_imports_from_transformers_decodes_as_it_does_and_exports_back(tmp_path):
    """Gemma 3 (text), built small and random by transformers: 5 layers, local ones over a window of 6 with
    every third global (layers 2 and 5 of 1..5 global, so the pattern repeats and a local layer follows
    it), local and global RoPE bases apart, query_pre_attn_scalar unlike head_dim, tied embeddings scaled by
    sqrt(width), Gemma's four norms a layer, GeGLU and query/key norms. Prompts of 24 tokens and a continuation
    of 10 run well past the window, so the local layers' ring caches wrap: our logits are theirs, our greedy
    continuation theirs (one row's prompt padded, to check a ring never takes in padding), and the exported
    directory loads back into transformers with the same logits."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           query_pre_attn_scalar=24, sliding_window=6, sliding_window_pattern=3,
                                           max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.2,
                                           rope_parameters={"full_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e6},
                                                            "sliding_attention": {"rope_type": "default",
                                                                                  "rope_theta": 1e4}})  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # Gemma's norm weights start at zero (a scale of one): make them matter
        for name, w in model.named_parameters():
            if "norm" in name:
                w.normal_(0, 0.3)
    gemma = dict(embed_scale=True, post_norms=True, mlp_activation="gelu_tanh", attn_scale_dim=24, qk_norm=True)
    cfg = micro_config(model=dict(n_layers=5, d_ff=96, head_dim=16, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True,
                                  sliding_window=6, global_every=3, local_rope_theta=1e4, **gemma))  # fmt: skip
    setup, params = round_trip(model, cfg, tmp_path, prompt=24, new=10)
    # Row 1's prompt is its first 17 tokens, then padding: it goes on as that prompt alone does.
    padded = np.asarray(
        make_generate(setup.spec, setup.shard, max_new_tokens=10)(params, TOKENS, 0, np.array([24, 17]))
    )
    with torch.no_grad():
        alone = model.generate(torch.tensor(TOKENS[1:, :17]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, 17:].numpy()  # fmt: skip
    np.testing.assert_array_equal(padded[1:], alone)


QWEN3_5 = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=64,
               rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                "partial_rotary_factor": 0.25})  # fmt: skip
QWEN3_5_OURS = dict(n_layers=4, head_dim=16, norm_eps=1e-6, qk_norm=True, attention_gate=True, centred_norms=True,
                    rope_fraction=0.25,
                    layer_types=("linear_attention",) * 3 + ("full_attention",),
                    linear=dict(key_heads=2, value_heads=4, key_dim=8, value_dim=8, conv_kernel=4))  # fmt: skip


def float64_logits(model):
    """transformers' logits for TOKENS in float64: the reference our float32 is held to (its own float32
    chunked form is itself ~1e-5 of the largest logit away from it)."""
    with torch.no_grad():
        logits = model.double()(torch.tensor(TOKENS)).logits.numpy()
    model.float()
    return logits


def qwen3_5(cls, config):
    """A small random Qwen3.5 of class `cls`, its norms and dt_bias (which start at a scale of one and at one)
    drawn, so that they matter."""
    model = cls(config)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if ("norm" in name or "dt_bias" in name) and "visual" not in name:
                w.normal_(0, 0.3)
    return model


def test_qwen3_5_imports_from_transformers_decodes_as_it_does_and_exports_back(tmp_path):
    """Qwen3.5 (text), built small and random by transformers: three Gated DeltaNet layers (two key heads
    each serving two value heads, a convolution of 4), then a full-attention layer with its output gate,
    query/key norms and RoPE over a quarter of each head; norms and decay parameters made to matter. Our
    logits are theirs to 1e-5 of their largest, our greedy continuation theirs through our KV cache and
    recurrent state (one row's prompt padded: a linear layer takes no padding in), and the export is their
    tensors exactly, loading back with the same logits. The 1e-5 is against transformers in float64: its own
    float32 is as far from that as ours."""
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    model = qwen3_5(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**QWEN3_5))
    cfg = micro_config(model=QWEN3_5_OURS)
    setup, params = round_trip(model, cfg, tmp_path, prompt=12, new=10)
    ours, exact = our_logits(cfg, str(tmp_path / "run")), float64_logits(model)
    assert np.abs(ours - exact).max() <= 1e-5 * np.abs(exact).max()
    exported, given = load_file(str(tmp_path / "out" / "model.safetensors")), model.state_dict()
    assert sorted(exported) == sorted(given)
    for name, tensor in given.items():
        np.testing.assert_array_equal(exported[name], tensor.numpy(), err_msg=name)
    padded = np.asarray(
        make_generate(setup.spec, setup.shard, max_new_tokens=10)(params, TOKENS[:, :12], 0, np.array([12, 7]))
    )
    with torch.no_grad():
        alone = model.generate(torch.tensor(TOKENS[1:, :7]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[:, 7:].numpy()  # fmt: skip
    np.testing.assert_array_equal(padded[1:], alone)


# Qwen3.5-MoE's and Qwen3-Next's mixture at micro size: 4 experts, 2 a token, a shared expert behind its gate.
QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
QWEN3_5_MOE_OURS = {**QWEN3_5_OURS, "d_ff": 32, "moe": dict(num_experts=4, experts_per_token=2, d_ff=32,
                                                             shared_experts=1, shared_gate=True)}  # fmt: skip


def moe_round_trip(model, tmp_path, **more):
    """round_trip of a hybrid with experts, our logits within 1e-5 of its float64 ones, and the export the
    saved tensors exactly (the per-expert files save_pretrained writes); returns the config imported with."""
    from safetensors.numpy import load_file

    model.set_experts_implementation("eager")  # its grouped kernel takes no float64
    cfg = micro_config(model=QWEN3_5_MOE_OURS)
    round_trip(model, cfg, tmp_path, prompt=12, new=10, **more)
    ours, exact = our_logits(cfg, str(tmp_path / "run")), float64_logits(model)
    assert np.abs(ours - exact).max() <= 1e-5 * np.abs(exact).max()
    exported, saved = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("out", "hf"))
    assert sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    return cfg


def test_qwen3_5_moe_imports_from_transformers_decodes_as_it_does_and_exports_back(tmp_path):
    """Qwen3.5-MoE (text): the same hybrid with a mixture in every layer, linear and full alike: four
    softmax-routed experts, two a token, and a shared expert gated per token by a sigmoid. As for Qwen3.5:
    our logits are transformers' (float64) to 1e-5 of their largest, greedy decoding is theirs token for
    token, and the export is their tensors exactly."""
    torch.manual_seed(0)
    text = {k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}
    config = transformers.Qwen3_5MoeTextConfig(**text, **QWEN3_5_MOE)
    moe_round_trip(qwen3_5(transformers.Qwen3_5MoeForCausalLM, config), tmp_path)


def test_qwen3_next_imports_decodes_as_transformers_does_and_exports_back_as_itself(tmp_path):
    """Qwen3-Next: Qwen3.5-MoE's arithmetic with q, k, v, z and b, a in projections grouped by key head. Our
    logits are transformers' (float64) to 1e-5 of their largest, greedy decoding theirs, and the export is
    Qwen3-Next again (the import keeps its form), its tensors the saved ones exactly."""
    torch.manual_seed(0)
    text = {k: v for k, v in QWEN3_5.items() if k != "rope_parameters"}
    config = transformers.Qwen3NextConfig(**text, **QWEN3_5_MOE, layer_types=["linear_attention"] * 3 +
                                          ["full_attention"], rope_parameters={"rope_type": "default",
                                          "rope_theta": 10_000.0, "partial_rotary_factor": 0.25})  # fmt: skip
    config.update(dict(max_position_embeddings=512, intermediate_size=336, router_aux_loss_coef=0.01))
    # The Hub's checkpoints carry multi-token prediction layers (mtp.*), which transformers does not load.
    rng = np.random.default_rng(1)
    mtp = {"mtp.fc.weight": rng.standard_normal((64, 128), np.float32),
           "mtp.pre_fc_norm_hidden.weight": rng.standard_normal(64, np.float32),
           "mtp.layers.0.self_attn.q_proj.weight": rng.standard_normal((128, 64), np.float32)}  # fmt: skip
    said = ("qwen3_next: what this trainer's model does not read set aside and put back on export (its "
            "multi-token prediction layers: 3 tensors, 16,448 parameters)")  # fmt: skip
    cfg = moe_round_trip(qwen3_5(transformers.Qwen3NextForCausalLM, config), tmp_path, extra=mtp, aside=said)
    with open(tmp_path / "out" / "config.json") as f:
        exported = json.load(f)
    # round_trip held every key to the source's (512 positions though the run's max_seq_len is 64; the dense MLP's
    # width 336, which no layer of experts reads, though the import took model.d_ff=32).
    assert exported["architectures"] == ["Qwen3NextForCausalLM"] and exported["intermediate_size"] == 336
    # A key that a run trained from the import changed is said with both values.
    said, eps = [], micro_config(model={**cfg.model.to_dict(), "norm_eps": 1e-5}, train=dict(steps=2),
                                 checkpoint={"init_from": str(tmp_path / "run")})  # fmt: skip
    train(eps, str(tmp_path / "eps"))
    export_checkpoint(eps, str(tmp_path / "eps"), None, str(tmp_path / "eps_out"), say=said.append)
    assert said == ["config.json: rms_norm_eps 1e-06 -> 1e-05 (the run's model differs from the imported one there)"]
    # Adapters on q, k, v (one A) and z have no PEFT form on its fused in_proj_qkvz: one sentence before anything
    # is read, nothing written.
    lora = micro_config(model=cfg.model.to_dict(), checkpoint={"init_from": str(tmp_path / "run")})
    lora.model.lora.update(rank=4, alpha=8.0)
    with pytest.raises(ConfigError, match=r"adapters on qkv,z have no PEFT form on Qwen3-Next, .*in_proj_qkvz"):
        export_checkpoint(lora, str(tmp_path / "run"), None, str(tmp_path / "adapter"), adapter=True)
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_hubs_qwen3_5_imports_its_text_model_and_exports_back_whole(tmp_path, moe):
    """The Hub's Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration (Qwen3.5-MoE's
    Qwen3_5MoeForConditionalGeneration): a vision tower beside the text model. One built small and random by
    transformers, saved and imported: the text model alone is read (the import says what it set aside), our
    logits are the model's on text (in float64) to 1e-5 of their largest, and the export is the same class,
    every tensor the saved one's (the vision tower's untouched), loading back with the same logits."""
    from safetensors.numpy import load_file

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)  # fmt: skip
    text, ours, kind = QWEN3_5, QWEN3_5_OURS, "Qwen3_5"
    if moe:  # Qwen3.5-MoE's Hub form: the same, with experts and a gated shared expert in every layer
        text = {**{k: v for k, v in QWEN3_5.items() if k != "intermediate_size"}, **QWEN3_5_MOE}
        ours, kind = QWEN3_5_MOE_OURS, "Qwen3_5Moe"
    cls = getattr(transformers, f"{kind}ForConditionalGeneration")
    model = qwen3_5(cls, getattr(transformers, f"{kind}Config")(text_config=text, vision_config=vision))
    if moe:
        model.set_experts_implementation("eager")  # its grouped kernel takes no float64
    model.save_pretrained(str(tmp_path / "hub"))
    cfg, workdir = micro_config(model=ours), str(tmp_path / "run")
    said = import_checkpoint(str(tmp_path / "hub"), cfg, workdir)
    pattern = (rf"{kind}ForConditionalGeneration: what this trainer's model does not read set aside and put back "
               r"on export \(its vision tower: \d+ tensors, [\d,]+ parameters\)")  # fmt: skip
    assert re.fullmatch(pattern, said), said
    ours, theirs, exact = our_logits(cfg, workdir), hf_logits(model), float64_logits(model)
    assert np.abs(ours - exact).max() <= 1e-5 * np.abs(exact).max()
    assert export_checkpoint(cfg, workdir, None, str(tmp_path / "out")) == 0
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["architectures"] == [f"{kind}ForConditionalGeneration"]
    saved = {}
    for name in os.listdir(tmp_path / "hub"):
        if name.endswith(".safetensors"):
            saved.update(load_file(str(tmp_path / "hub" / name)))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    back = cls.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    np.testing.assert_allclose(hf_logits(back), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["hub", "between"])
def test_gemma3_reads_every_published_form_of_its_config_as_transformers_does(tmp_path, form):
    """The Hub's own config.json (google/gemma-3-1b-it: sliding_window_pattern, rope_theta and
    rope_local_base_freq; no layer_types, no rope_parameters) and the form between it and today's
    (layer_types with the two thetas): transformers loads each into the same model, and our import of each
    gives its logits (local layers at a RoPE base of 1e4, global ones at 1e6)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=6,
        sliding_window_pattern=3,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
    )
    model = transformers.Gemma3ForCausalLM(config)
    model.save_pretrained(str(tmp_path / "hf"))
    with open(tmp_path / "hf" / "config.json") as f:
        saved = json.load(f)
    rope = saved.pop("rope_parameters")
    assert rope["sliding_attention"]["rope_theta"] == 1e4 and rope["full_attention"]["rope_theta"] == 1e6
    saved.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)
    if form == "hub":
        del saved["layer_types"]
        saved["sliding_window_pattern"] = 3
    with open(tmp_path / "hf" / "config.json", "w") as f:
        json.dump(saved, f)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert theirs.config.layer_types == config.layer_types
    np.testing.assert_allclose(hf_logits(theirs), hf_logits(model), rtol=1e-5, atol=1e-5)
    gemma = dict(embed_scale=True, post_norms=True, mlp_activation="gelu_tanh", attn_scale_dim=24, qk_norm=True)
    cfg = micro_config(model=dict(n_layers=5, d_ff=96, head_dim=16, norm_eps=1e-6, rope_theta=1e6, tie_embeddings=True,
                                  sliding_window=6, global_every=3, local_rope_theta=1e4, **gemma))  # fmt: skip
    import_checkpoint(str(tmp_path / "hf"), cfg, str(tmp_path / "run"))
    np.testing.assert_allclose(our_logits(cfg, str(tmp_path / "run")), hf_logits(theirs), rtol=1e-4, atol=1e-4)


def test_deepseek_v3_imports_from_transformers_decodes_as_it_does_and_exports_back(tmp_path):
    """DeepSeek-V3, built small and random by transformers: latent attention (q and kv latents with their
    norms, RoPE in interleaved pairs on 4 of each head's 12 query/key dims, values 12 wide), its first layer
    dense, then 8 experts under the sigmoid router with a random correction bias, 2 groups of which a token
    uses 1, weights times 2.5, a shared expert; our config adds a multi-token prediction module, which the
    import starts fresh and the export leaves out. Our logits are theirs, our greedy continuation (decoding
    from the cached latents) theirs, and the exported directory loads back into transformers with the same
    logits."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(vocab_size=384, hidden_size=64, intermediate_size=96,
                                           moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                                           num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                                           num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                           first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                                           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                                           max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-6,
                                           rope_interleave=True)  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name:
                w.normal_(1, 0.3)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    moe = dict(num_experts=8, experts_per_token=2, shared_experts=1, d_ff=32, dense_layers=1, router="sigmoid",
               routed_scale=2.5, groups=2, groups_per_token=1)  # fmt: skip
    cfg = micro_config(model=dict(n_layers=3, d_ff=96, n_kv_heads=4, norm_eps=1e-6, moe=moe, mtp=dict(depth=1),
                                  mla=dict(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=4, v_dim=12)))  # fmt: skip
    round_trip(model, cfg, tmp_path)


def test_kimi_k2_reads_as_deepseek_v3_with_yarn_and_one_group_of_experts(tmp_path):
    """Kimi K2's checkpoint is a DeepseekV3ForCausalLM: 384 experts in one group, 8 a token, its first layer
    dense, weights times 2.827, and YaRN RoPE (factor 32 over 4096 positions, beta_fast = beta_slow = 1,
    mscale = mscale_all_dim = 1), whose softmax temperature latent attention takes. Small, with those
    settings (16 experts, YaRN over 16 original positions so that its ramp cuts through the rotated pairs):
    our logits, greedy decoding and export are transformers'."""
    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 16,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    config = transformers.DeepseekV3Config(vocab_size=384, hidden_size=64, intermediate_size=96,
                                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=4, n_shared_experts=1, n_routed_experts=16,
                                           num_experts_per_tok=8, n_group=1, topk_group=1,
                                           routed_scaling_factor=2.827, first_k_dense_replace=1, q_lora_rank=24,
                                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                           max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
                                           rope_interleave=True, rope_parameters=yarn)  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" in name:
                w.normal_(1, 0.3)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    moe = dict(num_experts=16, experts_per_token=8, shared_experts=1, d_ff=32, dense_layers=1, router="sigmoid",
               routed_scale=2.827)  # fmt: skip
    scaling = dict(kind="yarn", factor=32.0, original_max_len=16, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=1.0)  # fmt: skip
    cfg = micro_config(model=dict(n_layers=2, d_ff=96, n_kv_heads=4, norm_eps=1e-6, moe=moe, rope_theta=50000.0,
                                  rope_scaling=scaling, max_seq_len=512,
                                  mla=dict(kv_rank=16, q_rank=24, nope_dim=8, rope_dim=8, v_dim=12)))  # fmt: skip
    round_trip(model, cfg, tmp_path)
    assert cfg.model.rope_scaling.kind == "yarn"  # the softmax temperature is in play: m(1)^2 at factor 32
    assert config.rope_parameters["mscale_all_dim"] == 1.0


def test_a_family_we_do_not_read_and_a_missing_extra_are_one_sentence_each(tmp_path, monkeypatch):
    import sys

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=384))
    gpt2.save_pretrained(str(tmp_path / "gpt2"))
    with pytest.raises(
        ConfigError,
        match=r"^this Hugging Face model is of model_type 'gpt2', which this trainer does "
        r"not read; it reads LlamaForCausalLM \(llama\), .*DeepseekV3ForCausalLM",
    ):
        import_checkpoint(str(tmp_path / "gpt2"), micro_config(), str(tmp_path / "run"))
    for kind, name in (("kimi_linear", "Kimi Linear"), ("olmo_hybrid", "OLMo Hybrid")):  # hybrids not read: named
        transformers.AutoConfig.for_model(kind).save_pretrained(str(tmp_path / kind))
        said = rf"^this Hugging Face model is a hybrid of linear and full attention \({name}, of model_type '{kind}'\)"
        with pytest.raises(ConfigError, match=said + ", which this trainer does not read"):
            import_checkpoint(str(tmp_path / kind), micro_config(), str(tmp_path / "run"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as where the hf extra is not installed
    with pytest.raises(ConfigError, match=r"needs the hf extra \(tokenizers is not installed\): pip install"):
        export_checkpoint(micro_config(), str(tmp_path / "none"), None, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()
