"""moe_tiny: configs/tiny.py with a mixture of experts in every layer, on a CPU.

    python scripts/train.py --config configs/moe_tiny.py

tiny's shape and data, each layer's MLP replaced by 8 experts of width 384 of which the router picks
2 per token: the same active parameters per token as tiny's MLP of 768 (plus a 256 x 8 router), four
times its MLP weights in all. Dropless (every token reaches both its experts), with the balancing
loss and router z-loss at their defaults. Same schedule as tiny: 450 steps of 16 x 256 tokens. The
README sets its validation loss beside tiny's. On more devices, `--config.mesh.expert=4` spreads the
experts over four of them.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "tiny.py"))
    c.model.moe.update(num_experts=8, experts_per_token=2, d_ff=384)
    c.train.update(sample_prompts=())  # the comparison with tiny is its loss
    return c
