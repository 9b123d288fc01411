"""lora_tiny: sft_tiny with low-rank adapters: the quick-start model frozen, rank-8 adapters trained.

    python scripts/train.py --config configs/quickstart.py         # the base model (runs/quickstart)
    python scripts/make_chat_data.py                                # runs/chat_data/{sft,dpo,sums,rl}/rows.jsonl
    python scripts/train.py --config configs/lora_tiny.py          # runs/lora_tiny
    python scripts/generate.py --config configs/lora_tiny.py --chat --prompt "Reverse: python"

The same conversations, loss and steps as sft_tiny, but only adapters on every projection (q, k, v, o,
gate, up, down) train, beside the quick-start weights (checkpoint.init_from, pinned at the run's start):
the optimiser's state is theirs alone, and a checkpoint holds them without the base. Adapters start as
nothing (B = 0) and take a larger learning rate than a full fine-tune's. docs/post_training.md compares
what it learns with sft_tiny's, and exports it for transformers and peft.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "sft_tiny.py"))
    c.model.lora.update(rank=8, alpha=16.0)
    c.optim.update(lr=5e-3)
    return c
