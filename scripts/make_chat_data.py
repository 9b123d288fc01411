"""Write the small corpora configs/sft_tiny.py, dpo_tiny.py and grpo_tiny.py train on (no download):

    python scripts/make_chat_data.py [--out runs/chat_data] [--rows 4000] [--seed 0]

The SFT and DPO task is a format a base model does not follow: the user asks for a word reversed and the
assistant answers `ANSWER: <the word reversed>`. <out>/sft/rows.jsonl holds conversations (`messages`; a
quarter of them with a system message, a quarter with two exchanges); <out>/dpo/rows.jsonl holds preference
pairs whose chosen reply is the answer in that format and whose rejected reply repeats the word, unreversed
and without the format.

GRPO's task is one a tiny model half-learns from examples, so that sampling finds right answers to
reinforce: sums of two numbers below 20 (`Add: 7+15`, answered `ANSWER: 22`). <out>/sums/rows.jsonl holds
such conversations, for an SFT run to start GRPO from; <out>/rl/rows.jsonl holds prompts (`prompt`, the
request) with their `answer` (the sum, a string), what GRPO samples completions for and checks. Both draw
from the same 400 sums: a held-out prompt is a new row, not a sum never seen.
"""

import json
import os
import string

import numpy as np
from absl import flags

from trainer.run import cli

_OUT = flags.DEFINE_string("out", "runs/chat_data", "Folder to write {sft,dpo,sums,rl}/rows.jsonl into.")
_ROWS = flags.DEFINE_integer("rows", 4000, "Rows of each corpus.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the words drawn.")


def word(rng) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), rng.integers(3, 9)))


def exchange(rng) -> list[dict]:
    w = word(rng)
    return [{"role": "user", "content": f"Reverse: {w}"}, {"role": "assistant", "content": f"ANSWER: {w[::-1]}"}]


def addition(rng) -> tuple[str, str]:
    a, b = (int(x) for x in rng.integers(0, 20, 2))
    return f"Add: {a}+{b}", str(a + b)


def main():
    rng = np.random.default_rng(_SEED.value)
    for name in ("sft", "dpo", "rl", "sums"):
        os.makedirs(os.path.join(_OUT.value, name), exist_ok=True)
    with open(os.path.join(_OUT.value, "sft", "rows.jsonl"), "w") as f:
        for i in range(_ROWS.value):
            messages = [{"role": "system", "content": "Answer briefly."}] if i % 4 == 1 else []
            messages += exchange(rng) + (exchange(rng) if i % 4 == 2 else [])
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(os.path.join(_OUT.value, "dpo", "rows.jsonl"), "w") as f:
        for _ in range(_ROWS.value):
            w = word(rng)
            f.write(json.dumps({"prompt": f"Reverse: {w}", "chosen": f"ANSWER: {w[::-1]}",
                                "rejected": w}) + "\n")  # fmt: skip
    with open(os.path.join(_OUT.value, "sums", "rows.jsonl"), "w") as f:
        for _ in range(_ROWS.value):
            prompt, answer = addition(rng)
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"ANSWER: {answer}"}]
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(os.path.join(_OUT.value, "rl", "rows.jsonl"), "w") as f:
        for _ in range(_ROWS.value):
            prompt, answer = addition(rng)
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    print(f"wrote {_ROWS.value} conversations to {_OUT.value}/sft, {_ROWS.value} pairs to {_OUT.value}/dpo, "
          f"{_ROWS.value} conversations of sums to {_OUT.value}/sums and {_ROWS.value} prompts to "
          f"{_OUT.value}/rl")  # fmt: skip


if __name__ == "__main__":
    cli.run(main)
