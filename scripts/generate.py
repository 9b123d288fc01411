"""Sample text from a checkpoint:

    python scripts/generate.py --config configs/tiny.py --workdir runs/tiny --prompt "def main(" \\
        [--max_new_tokens 200] [--temperature 0.8 --top_k 50 --top_p 0.95] [--seed 0] [--json]

--max_new_tokens defaults to 128, or to what fits in model.max_seq_len after the prompt.

Temperature 0 (the default) is greedy, and refuses --top_k or --top_p (they
only shape sampling). Generation uses a KV cache and runs
sharded on the config's mesh. With --json the output ends with one line
{"prompt", "completion"}.

With --chat it talks through the run's chat template (trainer/data/chat.py): --prompt is one user message
and gets one reply; without --prompt each line read from standard input is the user's next message, and
the conversation goes on until the input ends. A reply ends at the template's end of turn. When the
conversation outgrows model.max_seq_len its oldest exchanges are left out.
"""

import json
import sys

import numpy as np
from absl import flags

from trainer.config.errors import ConfigError
from trainer.data import chat, run_tokenizer
from trainer.data.tokenizers import load_tokenizer
from trainer.evaluation.samples import check_request, completion, prompt_ids
from trainer.model.sampling import make_generate
from trainer.run import cli
from trainer.training.resume import load_params

DEFAULT_NEW = 128
_CONFIG = cli.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default runs/<config name>.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default the newest.")
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens",
    None,
    f"Tokens to generate at most; default {DEFAULT_NEW}, or what fits in model.max_seq_len after the prompt.",
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample among the most likely tokens holding this probability mass.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_JSON = flags.DEFINE_bool("json", False, "End with a JSON line {prompt, completion}.")
_CHAT = flags.DEFINE_bool("chat", False, "Talk through the chat template: --prompt, or lines of standard input.")


NAMES = dict(new_tokens="--max_new_tokens", top_k="--top_k", top_p="--top_p", temperature="--temperature")


def main():
    cfg = _CONFIG.value
    if (_MAX_NEW.value or 1) < 1 or _TEMPERATURE.value < 0 or not 0 < _TOP_P.value <= 1 or _TOP_K.value < 0:
        raise ConfigError("need --max_new_tokens >= 1, --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0.")
    workdir = _WORKDIR.value or cli.default_workdir()
    cfg = run_tokenizer.settle(cfg, workdir)  # the run's own copy of its tokenizer
    tokenizer = load_tokenizer(cfg.data)
    if _CHAT.value:
        return talk(cfg, workdir, tokenizer)
    prompt = prompt_ids(tokenizer, _PROMPT.value)
    new = new_tokens(cfg, prompt)
    check_request(cfg, tokenizer, _PROMPT.value, new, NAMES, _TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
    setup, step, params = load_params(cfg, workdir, _STEP.value)
    prompt = prompt[None]
    generate = make_generate(
        setup.spec, setup.shard, max_new_tokens=new,
        temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
    )  # fmt: skip
    text = completion(tokenizer, np.asarray(generate(params, prompt, _SEED.value))[0])
    print(_PROMPT.value + text)
    if _JSON.value:
        print(json.dumps({"prompt": _PROMPT.value, "completion": text, "step": step}))


def new_tokens(cfg, prompt: np.ndarray) -> int:
    """--max_new_tokens, or by default DEFAULT_NEW or what fits after the prompt, whichever is fewer."""
    return _MAX_NEW.value or max(1, min(DEFAULT_NEW, cfg.model.max_seq_len - len(prompt)))


def talk(cfg, workdir: str, tokenizer) -> None:
    """--chat: one reply to --prompt, or a conversation over standard input. The first message's prompt, as
    the chat template renders it, is checked and sets the default number of new tokens."""
    template = chat.template_for(cfg.data, tokenizer)
    ends = chat.end_of_turn_ids(tokenizer, template)
    history: list[dict] = []
    generate = params = new = None
    lines = [_PROMPT.value] if _PROMPT.value else (line.rstrip("\n") for line in sys.stdin)
    for turn, message in enumerate(lines):
        history.append({"role": "user", "content": message})
        ids = chat.prompt_ids(tokenizer, template, history)
        if generate is None:
            new = new_tokens(cfg, ids)
            check_request(cfg, tokenizer, message, new, NAMES, _TEMPERATURE.value, _TOP_K.value, _TOP_P.value, ids)
            setup, _, params = load_params(cfg, workdir, _STEP.value)
            generate = make_generate(setup.spec, setup.shard, max_new_tokens=new, temperature=_TEMPERATURE.value,
                                     top_k=_TOP_K.value, top_p=_TOP_P.value)  # fmt: skip
        while len(ids) + new > cfg.model.max_seq_len and len(history) > 1:
            history = history[2:]  # the oldest exchange
            ids = chat.prompt_ids(tokenizer, template, history)
        check_request(cfg, tokenizer, message, new, NAMES, _TEMPERATURE.value, _TOP_K.value, _TOP_P.value, ids)
        out = [int(i) for i in np.asarray(generate(params, ids[None], _SEED.value + turn))[0]]
        cut = min((out.index(i) for i in ends if i in out), default=len(out))
        reply = tokenizer.decode(out[:cut])
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
        if _JSON.value:
            print(json.dumps({"prompt": message, "completion": reply}), flush=True)


if __name__ == "__main__":
    cli.run(main)
