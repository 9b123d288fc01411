"""sft_tiny: supervised fine-tuning of the quick-start model on conversations, on a CPU.

    python scripts/train.py --config configs/quickstart.py         # the base model (runs/quickstart)
    python scripts/make_chat_data.py                                # runs/chat_data/{sft,dpo,sums,rl}/rows.jsonl
    python scripts/train.py --config configs/sft_tiny.py           # runs/sft_tiny
    python scripts/generate.py --config configs/sft_tiny.py --chat --prompt "Reverse: python"

Starts from the quick-start run's weights (checkpoint.init_from) and trains 200 steps on conversations
where the user asks for a word reversed and the assistant answers "ANSWER: <reversed>", rendered through
the byte tokenizer's built-in chat template (trainer/data/chat.py) and trained on the assistant's tokens
only (data.loss_on=assistant). The base model never writes "ANSWER:"; after this it answers in that
format (tests/test_post_training.py measures it). docs/post_training.md has the whole path.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.data.update(name="chat_sft", paths="runs/chat_data/sft/*.jsonl", format="chat", loss_on="assistant",
                  validation_fraction=0.05)  # fmt: skip
    c.optim.update(lr=1e-3, warmup_steps=20, schedule="cosine", weight_decay=0.0)
    c.train.update(steps=200, log_every=20, eval_every=100, sample_prompts=())
    c.checkpoint.update({"every_steps": 100, "init_from": "runs/quickstart"})
    return c
