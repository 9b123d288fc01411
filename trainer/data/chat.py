"""Conversations as training documents: rows checked, rendered through a chat template, tokenised, and each
token told apart as context or reply.

A corpus of `data.format=chat` has rows with a `messages` list of {role, content} (the Hugging Face and
OpenAI form), or a `prompt` and a `completion` (a string each, taken as one user and one assistant turn, or
lists of messages); `data.format=preference` has rows with a `prompt` and the `chosen` and `rejected`
replies (strings, or lists of assistant messages), what DPO trains on; `data.format=prompts` rows with a
`prompt` (a string or messages) and an `answer` (any JSON value), what reinforcement learning samples
completions for and rewards (trainer/objectives/rewards.py). Preparing one stores each row as a
canonical JSON text (`row_text`), checked then, so that a bad row is named by its file and line before
anything is trained.

A row becomes tokens through the chat template (`Template`): the Hugging Face tokenizer's own (the
`chat_template` of its tokenizer_config.json, or a chat_template.jinja beside it), rendered with the Jinja
environment transformers' `apply_chat_template` uses, and tokenised as it tokenises the rendering (special
tokens spelt in the text are those tokens); our byte and SentencePiece tokenizers have BUILT_IN, whose `<s>`
and `</s>` are their begin and end ids. `data.chat_template` may name a .jinja file instead.

Which tokens a reply covers comes from rendering the conversation's prefixes: the i-th message, if it is
the assistant's, spans from the end of the rendering of the messages before it with the generation prompt
to the end of the rendering of the messages up to it, its end-of-turn mark included, so the model learns
to stop. Each token carries a code (`turns`): CONTEXT, REPLY, or LAST_REPLY for the last turn (the run of
assistant messages that ends the conversation: a preference pair's whole reply).
`data.loss_on` then picks the tokens trained on (`loss_mask`): all, every reply, or the last one.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from trainer.config.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
CONTEXT, REPLY, LAST_REPLY = 0, 1, 2  # a token's code in `turns`

# Ours (byte, SentencePiece) have no tokens for roles: plain-text headers, and the end-of-document id after
# each reply, which is where generation stops. An export writes it as the exported tokenizer's template.
BUILT_IN = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# How ours spell their marks in a rendering (as their export to transformers names them).
MARKS = {"<pad>": 0, "<s>": 1, "</s>": 2}


ROW_FIELDS = {"chat": "messages|prompt,completion", "preference": "prompt,chosen,rejected", "prompts": "prompt,answer"}


def fields(format: str) -> str:
    """What a corpus of `format` records as its text field (trainer/data/preparation/split.py made_from)."""
    return ROW_FIELDS[format]


def format_of(text_field: str) -> str:
    """The data.format a corpus was prepared as, from the text field it records (any other field: text)."""
    return next((f for f, v in ROW_FIELDS.items() if v == text_field), "text")


# ---- rows ----


def row_text(row, format: str, loss_on: str, where: str) -> str:
    """The canonical JSON a prepared corpus stores for a row of `format`, or one sentence naming the row
    (`where`: its file and line) and what is wrong with it."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is not a JSON object; each row of a {format} corpus is one.")
    if format == "prompts":  # reinforcement learning's: the prompt as given (a reward sees it so), any JSON answer
        missing = [k for k in ("prompt", "answer") if k not in row or row[k] in ("", None, [])]
        if missing:
            raise ConfigError(f"{where} has no {' or '.join(missing)}; each row of a prompts corpus needs a prompt and "
                              "the answer its reward checks.")  # fmt: skip
        if prompt_messages(row["prompt"], where)[-1]["role"] == "assistant":
            raise ConfigError(f"{where}: its prompt ends with an assistant message; it ends where the reply begins.")
        out = {"prompt": row["prompt"], "answer": row["answer"]}
    elif format == "preference":
        missing = [k for k in ("prompt", "chosen", "rejected") if not row.get(k)]
        if missing:
            raise ConfigError(
                f"{where} has no {' or '.join(missing)}; each row of a preference corpus needs a prompt, the chosen "
                "reply and the rejected one."
            )
        out = {"prompt": _messages(row["prompt"], "user", where, "prompt"),
               **{k: _messages(row[k], "assistant", where, k) for k in ("chosen", "rejected")}}  # fmt: skip
        for k in ("chosen", "rejected"):
            if any(m["role"] != "assistant" for m in out[k]):
                raise ConfigError(f"{where}: its {k} reply holds messages of other roles than assistant.")
        if out["prompt"][-1]["role"] == "assistant":
            raise ConfigError(f"{where}: its prompt ends with an assistant message; it ends where the reply begins.")
    else:
        if "messages" in row:
            messages = _messages(row["messages"], "user", where, "messages")
        elif "prompt" in row and "completion" in row:
            messages = _messages(row["prompt"], "user", where, "prompt")
            messages += _messages(row["completion"], "assistant", where, "completion")
        else:
            raise ConfigError(
                f"{where} has neither a messages list nor a prompt and a completion; a chat corpus's rows have one "
                "of those (or set data.format=text for plain text)."
            )
        if loss_on != "all" and not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(
                f"{where} has no assistant turn, and data.loss_on={loss_on} trains on assistant turns only; drop "
                "the row, or set data.loss_on=all."
            )
        out = {"messages": messages}
    return json.dumps(out, ensure_ascii=False, sort_keys=True)


def prompt_messages(prompt, where: str = "a prompt") -> list[dict]:
    """A prompts row's prompt (a string: one user turn; or a list of messages) as messages, checked."""
    return _messages(prompt, "user", where, "prompt")


def _messages(value, role: str, where: str, field: str) -> list[dict]:
    """A string as one message of `role`, or a list of {role, content} checked."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: its {field} is neither text nor a list of messages.")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise ConfigError(f"{where}: a message of its {field} is not an object with a role and text content.")
        if m["role"] not in ROLES:
            raise ConfigError(
                f"{where}: a message of its {field} has the unknown role {m['role']!r}; roles are {', '.join(ROLES)}."
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ---- templates ----


@dataclasses.dataclass(frozen=True)
class Template:
    source: str  # the Jinja text
    marks: tuple[tuple[str, str], ...]  # (bos_token, "<s>"), ...: the special tokens the template may spell
    origin: str  # where it came from, for sentences

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return _compiled(self.source).render(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=generation_prompt, **dict(self.marks))  # fmt: skip


def template_for(data_cfg, tokenizer) -> Template:
    """The template the config's conversations are rendered with (see the module's docstring)."""
    marks = _mark_names(data_cfg, tokenizer)
    given = data_cfg.chat_template
    if given:
        from etils import epath

        path = epath.Path(given).expanduser()
        if not path.exists():
            raise ConfigError(f"data.chat_template={given!r} does not exist; give a .jinja file, or '' for the "
                              "tokenizer's own.")  # fmt: skip
        return Template(path.read_text(), marks, given)
    if data_cfg.tokenizer != "hf":
        return Template(BUILT_IN, marks, "the built-in template")
    source = hf_template(tokenizer.file)
    if source is None:
        raise ConfigError(
            f"the tokenizer at data.tokenizer_path={data_cfg.tokenizer_path!r} has no chat template (no chat_template "
            "in its tokenizer_config.json, no chat_template.jinja beside it); give one with data.chat_template=FILE."
        )
    return Template(source, marks, f"the chat template of {data_cfg.tokenizer_path}")


def hf_template(tokenizer_file: str) -> str | None:
    """A Hugging Face tokenizer's template: chat_template.jinja beside its tokenizer.json, else the
    `chat_template` of its tokenizer_config.json (its `default` where it holds several)."""
    from etils import epath

    folder = epath.Path(tokenizer_file).parent
    if (folder / TEMPLATE_FILE).exists():
        return (folder / TEMPLATE_FILE).read_text()
    config = folder / "tokenizer_config.json"
    found = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found}
        found = named.get("default")
    return found


TEMPLATE_FILE = "chat_template.jinja"


def _mark_names(data_cfg, tokenizer) -> tuple[tuple[str, str], ...]:
    if data_cfg.tokenizer != "hf":
        return (("bos_token", "<s>"), ("eos_token", "</s>"), ("pad_token", "<pad>"))
    names = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id, "pad_token": tokenizer.pad_id}
    return tuple((k, tokenizer.piece(i)) for k, i in names.items())


@functools.cache
def _compiled(source: str):
    """The template compiled as transformers compiles it: a sandbox, trimmed blocks, loop controls, its
    `tojson`, `raise_exception` and `strftime_now`, and `{% generation %}` blocks rendered as they are."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---- tokens ----


def encode(tokenizer, template: Template, text: str, where: str = "a row") -> dict[str, np.ndarray]:
    """A prepared row (row_text) as token ids and each token's code: {"tokens", "turns"}, and for a preference
    row also {"rejected", "rejected_turns"} (prompt and chosen reply, prompt and rejected reply)."""
    row = json.loads(text)
    if "answer" in row:  # a prompts row: the prompt rendered up to the reply it asks for
        return {"tokens": prompt_ids(tokenizer, template, prompt_messages(row["prompt"], where))}
    if "messages" in row:
        tokens, turns = conversation(tokenizer, template, row["messages"], where)
        return {"tokens": tokens, "turns": turns}
    chosen = conversation(tokenizer, template, row["prompt"] + row["chosen"], where)
    rejected = conversation(tokenizer, template, row["prompt"] + row["rejected"], where)
    return {"tokens": chosen[0], "turns": chosen[1], "rejected": rejected[0], "rejected_turns": rejected[1]}


def conversation(tokenizer, template: Template, messages: list[dict], where: str = "a conversation"):
    """(token ids, each token's code) of a rendered conversation.

    The last turn (LAST_REPLY) is the run of assistant messages that ends the conversation, taken whole from
    the generation prompt before its first to the end of its last, as TRL takes a preference pair's reply of
    several messages; in a conversation that ends otherwise, its last assistant message."""
    try:
        text = template.render(messages)
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last = len(messages)
        while last and messages[last - 1]["role"] == "assistant":
            last -= 1
        last = min(last, replies[-1]) if replies else -1
        spans = []
        for i in replies:
            before = _reply_start(template, messages, i)
            upto = template.render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ConfigError(
                    f"{template.origin} does not render {where}'s conversation up to its turn {i} as the start of "
                    "the whole (it rewrites earlier turns), so its replies cannot be told from their context; give "
                    "another with data.chat_template=FILE."
                )
            if i > last:  # the last turn's later messages: one span with its first, the headers between included
                spans[-1] = (spans[-1][0], len(upto), LAST_REPLY)
            else:
                spans.append((len(before), len(upto), LAST_REPLY if i == last else REPLY))
    except ConfigError:
        raise
    except Exception as e:  # Jinja's errors, and a template's own raise_exception
        raise ConfigError(f"{template.origin} fails to render {where} ({type(e).__name__}: {e}).") from e
    ids, starts = tokenizer.encode_marked(text)
    turns = np.full(len(ids), CONTEXT, np.int32)
    for begin, end, code in spans:
        turns[(starts >= begin) & (starts < end)] = code
    return ids.astype(np.int32), turns


def _reply_start(template: Template, messages: list[dict], i: int) -> str:
    """The rendering up to where message i's reply begins: the messages before it with the generation prompt.
    A conversation that opens with the assistant has none before it: its begin mark and role header are
    context too, found by rendering no message with the generation prompt, or, for a template that cannot
    render no message, where the reply's text begins."""
    if i:
        return template.render(messages[:i], generation_prompt=True)
    try:
        empty = template.render([], generation_prompt=True)
        if template.render(messages[:1]).startswith(empty):
            return empty
    except Exception:  # Jinja's errors: a template that reads messages[0]
        pass
    marked = template.render([{"role": "assistant", "content": _SENTINEL}])
    return marked[: marked.index(_SENTINEL)] if _SENTINEL in marked else ""


_SENTINEL = "\ue000reply\ue000"  # a private-use text no template writes of its own


def loss_mask(turns: np.ndarray, loss_on: str) -> np.ndarray:
    """1 where a token is trained on (as a target) under data.loss_on."""
    if loss_on == "all":
        return np.ones_like(turns)
    return (turns >= REPLY if loss_on == "assistant" else turns == LAST_REPLY).astype(np.int32)


def prompt_ids(tokenizer, template: Template, messages: list[dict]) -> np.ndarray:
    """A conversation rendered up to the assistant's next reply (the generation prompt): what a chat
    continues from."""
    return tokenizer.encode_marked(template.render(messages, generation_prompt=True))[0].astype(np.int32)


def end_of_turn_ids(tokenizer, template: Template) -> set[int]:
    """The ids a reply ends at: the end-of-document id, and the template's end-of-turn token where it has one
    (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`): the one token the rendering puts after a reply's text."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "REPLY"}]
    text = template.render(probe)
    after = text[text.rindex("REPLY") + len("REPLY") :].split("\n")[0]
    ids = tokenizer.encode_marked(after)[0] if after else []
    return {tokenizer.eos_id} | ({int(ids[0])} if len(ids) == 1 else set())
