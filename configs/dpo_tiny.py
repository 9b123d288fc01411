"""dpo_tiny: direct preference optimisation of the SFT model (configs/sft_tiny.py), on a CPU.

    python scripts/train.py --config configs/dpo_tiny.py           # runs/dpo_tiny, from runs/sft_tiny

Pairs whose chosen reply reverses the word and whose rejected one repeats it (scripts/make_chat_data.py),
100 steps of DPO's sigmoid loss at beta 0.1 against the frozen SFT weights (checkpoint.init_from, which is
also where the policy starts). The log shows the loss falling from log 2 = 0.693 and dpo/accuracy (the
share of pairs whose chosen reply the policy prefers more than the reference did) rising from 0.
"""

import os

from trainer.config import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "sft_tiny.py"))
    c.data.update(name="chat_dpo", paths="runs/chat_data/dpo/*.jsonl", format="preference")
    c.optim.update(lr=3e-4, warmup_steps=10, weight_decay=0.0)
    c.train.update(steps=100, global_batch_size=16, log_every=10, eval_every=50)
    c.checkpoint.update({"every_steps": 50, "init_from": "runs/sft_tiny"})
    return c
