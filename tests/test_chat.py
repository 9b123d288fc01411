"""Conversations as documents (trainer/data/chat.py): real chat templates rendered token for token as
transformers' apply_chat_template renders them, the replies told from their context, the built-in template
through an export, and bad rows refused in one sentence."""

import json
import os
import sysconfig

import numpy as np
import pytest
from conftest import micro_config

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
trl = pytest.importorskip("trl", reason="the post extra (TRL's real chat templates) is not installed")

from trainer.config.errors import ConfigError  # noqa: E402
from trainer.data import chat, corpora  # noqa: E402
from trainer.data.tokenizers import ByteTokenizer, load_tokenizer, train_sentencepiece  # noqa: E402
from trainer.interop.huggingface import write_generation_config, write_tokenizer  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
# Two families: ChatML (Qwen 2.5: a default system turn, <|im_end|> after every turn) and Llama 3 (headers,
# contents trimmed, <|eot_id|>, BOS spelt by the template). What ends a reply, written out by hand.
FAMILIES = {
    "qwen2_5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|im_end|>", "<|im_end|>\n"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"),
}  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "ANSWER: cba"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there, ünïcode ✓"},
     {"role": "assistant", "content": "Hello.\n\nHow can I help?"}, {"role": "user", "content": "Reverse: xy"},
     {"role": "assistant", "content": "ANSWER: yx"}],
    # Opening with the assistant: its begin mark and header are context, as every other reply's are.
    [{"role": "assistant", "content": "Hello, ask me."}, {"role": "user", "content": "Reverse: ab"},
     {"role": "assistant", "content": "ANSWER: ba"}],
]  # fmt: skip


def hf_tokenizer_with(directory, family: str) -> str:
    """A small byte-level BPE trained here, with `family`'s special tokens and its real template (from TRL)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, bos, eos, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train([os.path.join(sysconfig.get_paths()["stdlib"], "json", "__init__.py")], trainer)
    os.makedirs(directory)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(TEMPLATES, f"{family}.jinja")) as f:
        template = f.read()
    config = {"bos_token": bos, "eos_token": eos, "chat_template": template,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_real_template_renders_token_for_token_as_transformers_and_marks_the_replies(tmp_path, family):
    path = hf_tokenizer_with(tmp_path / family, family)
    data = micro_config(data=dict(tokenizer="hf", tokenizer_path=path, format="chat")).data
    ours, theirs = load_tokenizer(data), transformers.AutoTokenizer.from_pretrained(path)
    template = chat.template_for(data, ours)
    end = FAMILIES[family][3]
    for messages in CONVERSATIONS:
        ids, turns = chat.conversation(ours, template, messages)
        assert ids.tolist() == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False))
        prompt = chat.prompt_ids(ours, template, messages[:-1])
        assert prompt.tolist() == list(theirs.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False))  # fmt: skip
        # The replies are the assistants' texts with their end of turn, nothing of the context.
        replies = [m["content"].strip() + end for m in messages if m["role"] == "assistant"]
        assert theirs.decode(ids[turns >= chat.REPLY].tolist()) == "".join(replies)
        assert theirs.decode(ids[turns == chat.LAST_REPLY].tolist()) == replies[-1]
        assert ids[: len(prompt)].tolist() == prompt.tolist()
    assert chat.end_of_turn_ids(ours, template) == {ours.eos_id, theirs.convert_tokens_to_ids(end.strip())}
    # An export's generate stops at the end of a turn in transformers too (its generation_config.json).
    os.makedirs(tmp_path / "export")
    write_generation_config(data, str(tmp_path / "export"))
    stops = transformers.GenerationConfig.from_pretrained(str(tmp_path / "export")).eos_token_id
    want = {ours.eos_id, theirs.convert_tokens_to_ids(end.strip())}
    assert set(stops if isinstance(stops, list) else [stops]) == want


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_the_built_in_template_renders_as_the_export_renders_it_in_transformers(tmp_path, kind):
    path = ""
    if kind == "sentencepiece":
        stdlib = sysconfig.get_paths()["stdlib"]
        texts = [open(os.path.join(stdlib, "json", f)).read() for f in ("__init__.py", "decoder.py", "encoder.py")]
        path = str(tmp_path / "spm.model")
        train_sentencepiece(texts, 400, path)
    data = micro_config(data=dict(tokenizer=kind, tokenizer_path=path, format="chat")).data
    write_tokenizer(data, str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = load_tokenizer(data)
    template = chat.template_for(data, ours)
    for messages in CONVERSATIONS:
        ids, turns = chat.conversation(ours, template, messages)
        assert ids.tolist() == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert ids[0] == ours.bos_id and ids[-1] == ours.eos_id
        last = messages[-1]["content"]
        assert ours.decode(ids[turns == chat.LAST_REPLY].tolist()) == last  # and its end-of-document id
        assert ids[turns == chat.LAST_REPLY][-1] == ours.eos_id
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert ours.decode(ids[turns >= chat.REPLY].tolist()) == "".join(replies)
    if kind == "byte":  # the end of each reply is the end-of-document id, where generation stops
        ids, turns = chat.conversation(ByteTokenizer(), template, CONVERSATIONS[1])
        assert (ids[turns >= chat.REPLY] == ours.eos_id).sum() == 2


def test_bad_rows_are_refused_in_one_sentence_naming_them(tmp_path):
    def refused(row, format="chat", loss_on="assistant"):
        with pytest.raises(ConfigError) as e:
            chat.row_text(row, format, loss_on, "line 7 of rows.jsonl")
        return str(e.value)

    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    assert "line 7 of rows.jsonl has no assistant turn" in refused(user_only)
    assert json.loads(chat.row_text(user_only, "chat", "all", "x"))["messages"] == user_only["messages"]
    assert "unknown role 'bot'" in refused({"messages": [{"role": "bot", "content": "hi"}]})
    assert "no rejected" in refused({"prompt": "p", "chosen": "c"}, "preference")
    assert "neither a messages list" in refused({"text": "plain"})
    # A template that refuses to render a row (its own raise_exception), named with the row.
    failing = tmp_path / "strict.jinja"
    failing.write_text("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}"
                       "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    data = micro_config(data=dict(format="chat", chat_template=str(failing))).data
    template = chat.template_for(data, ByteTokenizer())
    with pytest.raises(ConfigError, match="fails to render line 3 of x.jsonl .*a system turn first"):
        row = chat.row_text({"messages": CONVERSATIONS[0]}, "chat", "assistant", "x")
        chat.encode(ByteTokenizer(), template, row, "line 3 of x.jsonl")
    # Through preparation: the row is named and nothing is published.
    rows = tmp_path / "rows"
    rows.mkdir()
    lines = [{"messages": CONVERSATIONS[0]}] * 5 + [{"messages": [{"role": "user", "content": "no reply"}]}]
    (rows / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = micro_config(data=dict(source="text_files", format="chat", paths=str(rows / "*.jsonl"), name="bad_chat",
                                 data_dir=str(tmp_path / "tfds")))  # fmt: skip
    with pytest.raises(ConfigError, match=r"line 6 of .*a.jsonl has no assistant turn"):
        corpora.prepare(cfg.data, say=lambda *_: None)
    assert not list((tmp_path / "tfds").rglob("dataset_info.json"))


def test_a_conversation_corpus_prepares_into_a_tokenised_store_equal_to_rendering_it(tmp_path):
    from trainer.data import streams

    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "a.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 20))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in CONVERSATIONS * 10]), rows / "b.parquet")
    pairs = [{"prompt": "Reverse: ab", "chosen": "ANSWER: ba", "rejected": "ANSWER: ab"}] * 40
    (rows / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    for format, globs in (("chat", f"{rows}/a.jsonl,{rows}/b.parquet"), ("preference", f"{rows}/p.jsonl")):
        base = micro_config(data=dict(source="text_files", format=format, paths=globs, name=format,
                                      data_dir=str(tmp_path / "tfds"), validation_fraction=0.1))  # fmt: skip
        docs = {}
        for tokenized in (False, True):
            base.data.tokenized = tokenized
            corpora.prepare(base.data, say=lambda *_: None)
            found = streams.documents(streams.Stream.from_config(base), "train", shuffle=False, endless=False)
            docs[tokenized] = [found[i] for i in range(3)]
        for a, b in zip(docs[False], docs[True], strict=True):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        text = ByteTokenizer().decode(docs[True][0]["tokens"][docs[True][0]["loss_mask"] > 0])
        assert text in ("ANSWER: cba", "Hello.\n\nHow can I help?ANSWER: yx", "ANSWER: ba")
        # Read as another format than it was prepared as: one sentence naming both, whether it is prepared
        # again (the same command that prepared it) or read.
        base.data.format = "text"
        for check in (corpora.prepare, corpora.check_prepared):
            with pytest.raises(ConfigError, match=rf"prepared with data.format={format}, and this config reads it "
                                                  rf"with data.format=text; set data.format={format}"):  # fmt: skip
                check(base.data) if check is corpora.prepare else check(base.data, "train")
    # And the other way: a text corpus read as conversations.
    (rows / "t.jsonl").write_text("".join(json.dumps({"text": f"note {i}"}) + "\n" for i in range(40)))
    text = micro_config(data=dict(source="text_files", paths=f"{rows}/t.jsonl", name="notes",
                                  data_dir=str(tmp_path / "tfds")))  # fmt: skip
    corpora.prepare(text.data, say=lambda *_: None)
    text.data.format = "chat"
    with pytest.raises(ConfigError, match=r"prepared with data.format=text, and this config reads it with "
                                          r"data.format=chat; set data.format=text"):  # fmt: skip
        corpora.prepare(text.data, say=lambda *_: None)


def test_a_chat_template_file_is_kept_with_the_run_and_another_is_refused(tmp_path):
    from trainer.data import run_tokenizer
    from trainer.storage import workdir as wd

    given = tmp_path / "mine.jinja"
    given.write_text("{# mine #}" + chat.BUILT_IN)
    cfg = micro_config(data=dict(format="chat", source="text_files", chat_template=str(given)))
    workdir = str(tmp_path / "run")
    run_tokenizer.store(cfg, workdir)
    wd.write_config(workdir, run_tokenizer.use_copy(cfg, workdir))
    given.unlink()  # another machine, or a file since moved: the run still renders as it trained
    settled = run_tokenizer.settle(cfg, workdir)
    assert chat.template_for(settled.data, ByteTokenizer()).source.startswith("{# mine #}")
    given.write_text(chat.BUILT_IN)
    with pytest.raises(ConfigError, match="is another template than the one .* was trained with"):
        run_tokenizer.settle(cfg, workdir)


def test_a_preference_reply_of_several_messages_is_scored_whole_as_trl_scores_it(tmp_path):
    """A chosen reply of two assistant messages: every token after the prompt is scored (the header between
    them too), as TRL's own rendering of the pair cuts it."""
    from trl.data_utils import maybe_apply_chat_template

    data = micro_config(data=dict(tokenizer="byte", format="preference")).data
    write_tokenizer(data, str(tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ours = load_tokenizer(data)
    row = {"prompt": [{"role": "user", "content": "Reverse: abc"}],
           "chosen": [{"role": "assistant", "content": "Let me see."}, {"role": "assistant", "content": "ANSWER: cba"}],
           "rejected": [{"role": "assistant", "content": "abc"}]}  # fmt: skip
    encoded = chat.encode(ours, chat.template_for(data, ours), chat.row_text(row, "preference", "all", "row 1"))
    rendered = maybe_apply_chat_template(row, theirs)
    for ids, turns, reply in ((encoded["tokens"], encoded["turns"], rendered["chosen"]),
                              (encoded["rejected"], encoded["rejected_turns"], rendered["rejected"])):  # fmt: skip
        scored = ids[chat.loss_mask(turns, "last_turn") > 0].tolist()
        assert theirs.decode(scored) == reply
        assert theirs.decode(ids.tolist()) == rendered["prompt"] + reply
