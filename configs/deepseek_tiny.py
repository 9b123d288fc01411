"""deepseek_tiny: configs/quickstart.py's model in DeepSeek-V3's form, on a CPU in a few minutes.

    python scripts/train.py --config configs/deepseek_tiny.py

Latent attention (4 heads; keys and values from a 64-wide latent, queries from a 96-wide one, each head's
query and key 32 wide plus a 16-wide RoPE part, values 32 wide), the first layer dense, then 8 experts of
width 128 under DeepSeek-V3's sigmoid router (2 per token within the best of 2 groups, weights times 2.5,
loss-free balancing), a shared expert beside them, and one multi-token prediction module at weight 0.3.
quickstart's data, batch and schedule: 300 steps of 32 x 128 bytes (docs/model_families.md has its loss
beside quickstart's).
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.model.update(n_kv_heads=4)  # latent attention has no key/value heads of its own
    c.model.mla.update(kv_rank=64, q_rank=96, nope_dim=32, rope_dim=16, v_dim=32)
    c.model.moe.update(num_experts=8, experts_per_token=2, shared_experts=1, d_ff=128, dense_layers=1,
                       router="sigmoid", routed_scale=2.5, groups=2, groups_per_token=1, router_bias=0.001,
                       aux_loss=0.0001)  # fmt: skip
    c.model.mtp.update(depth=1, weight=0.3)
    return c
