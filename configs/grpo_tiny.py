"""grpo_tiny: reinforcement learning (GRPO) on a reward a program checks, on a CPU.

    python scripts/train.py --config configs/quickstart.py         # the base model (runs/quickstart)
    python scripts/make_chat_data.py                                # runs/chat_data/{sft,dpo,sums,rl}/rows.jsonl
    python scripts/train.py --config configs/sft_tiny.py --workdir runs/sft_sums \
        --config.data.name=chat_sums --config.data.paths=runs/chat_data/sums/*.jsonl   # SFT on sums
    python scripts/train.py --config configs/grpo_tiny.py          # runs/grpo_tiny

The task is sums of two numbers below 20 (`Add: 7+15`, answered `ANSWER: 22`). sft_tiny's recipe on
conversations of sums (runs/sft_sums) gets about a quarter of the held-out prompts right; GRPO starts from
its weights. Each step samples 8 completions of each of 4 prompts from the policy being trained
(trainer/training/rollouts.py), rewards each with `exact` (1 if its answer is the sum) and a tenth of
`format` (1 if it keeps the format), and takes GRPO's clipped step with a KL pull (rl.beta) towards the
weights it started from. The held-out prompts' greedy answers are scored every 100 steps (eval_solved: the
share exactly right); docs/post_training.md has the numbers before and after.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "sft_tiny.py"))
    c.data.update(name="chat_sums_rl", paths="runs/chat_data/rl/*.jsonl", format="prompts", validation_fraction=0.05)
    c.rl.update(reward="exact,format", reward_weights="1,0.1", format_regex=r"^ANSWER: [0-9]+$", group_size=8,
                max_new_tokens=16, temperature=1.0, beta=0.04, epsilon=0.2, loss="grpo")  # fmt: skip
    c.optim.update(lr=1e-4, warmup_steps=10, schedule="cosine", weight_decay=0.0)
    c.train.update(steps=600, global_batch_size=32, log_every=10, eval_every=100, eval_batches=16)
    c.checkpoint.update({"every_steps": 50, "init_from": "runs/sft_sums"})
    return c
