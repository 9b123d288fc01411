"""moe_1b: configs/llm_1b.py with a mixture of experts: about 1.4B parameters active per token of 7.3B.

    python scripts/plan.py --config configs/moe_1b.py --target v5p-32   # compiled by XLA:TPU for 16 chips
    python scripts/plan.py --config configs/moe_1b.py --target h100-8 --config.model.attention=xla
                                        # and by XLA:GPU for one host (cuDNN's attention compiles on a GPU host)
    python scripts/train.py --config configs/moe_1b.py

llm_1b's attention and shape (16 layers, d_model 2048, GQA 32/8, 32k vocabulary, 2048-token sequences),
its first layer dense (SwiGLU 8192) and the other 15 with 64 experts of width 1024, the router picking 8
per token, beside one shared expert: a token meets 9 x 1024 of MLP width (llm_1b: 8192). The experts are
split over 8 devices (mesh.expert), everything else sharded FSDP-style over all of them. Capacity-bound
(factor 1.25, DeepSeek and MaxText's usual): fixed all-to-all buffers 1.25 x the tokens' copies, where
the dropless exchange pads each destination to all of them (8 x). The balancing loss at 0.01 and the
router's z-loss at 0.001.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "llm_1b.py"))
    c.model.moe.update(num_experts=64, experts_per_token=8, shared_experts=1, d_ff=1024, dense_layers=1,
                       impl="capacity", capacity_factor=1.25)  # fmt: skip
    c.mesh.update(expert=8, fsdp=-1)
    return c
