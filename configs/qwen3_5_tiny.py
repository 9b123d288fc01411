"""qwen3_5_tiny: the quick start's model as a Qwen3.5-style hybrid, trained from scratch on the same corpus.

    python scripts/train.py --config configs/qwen3_5_tiny.py

Four layers of width 128 as configs/quickstart.py has, of which the first three are Gated DeltaNet
(linear attention with a fixed-size state per head, trainer/model/delta.py) and the fourth full attention
with Qwen3.5's output gate, query/key norms and RoPE over a quarter of each head: the 3:1 pattern of
Qwen3.5 and Qwen3-Next. Same data, batch, steps and schedule as the quick start, d_ff 336 so that the
parameter count is the quick start's (884,024 against 885,888). Measured on a two-core VM (one seed each):
a validation loss of 1.4719 on the whole held-out split against the quick start's 1.6967, 0.37-0.40 s a
step against 0.27-0.33 (docs/model_families.md).

Fine-tuning a real Qwen3.5 with LoRA: import the Hub's checkpoint (its text model; the vision tower is set
aside) into a run with the config of its size (configs/qwen3_5_9b.py for Qwen3.5-9B), then train adapters
beside its frozen weights, with --config.data.paths at your corpus:

    python scripts/convert_hf.py import --hf hf/Qwen3.5-9B --config configs/qwen3_5_9b.py --workdir runs/qwen3_5_9b
    python scripts/train.py --config runs/qwen3_5_9b/config.json --config.model.lora.rank=16 \
        --config.checkpoint.init_from=runs/qwen3_5_9b --workdir runs/qwen3_5_9b_lora

For another size the import refuses in one sentence that lists each model.* key to set and its value: add
those flags to the import (which itself takes no adapters: they start at the train command). The adapters go
on every projection by default: full attention's q (its gate's rows too), k, v, o, the MLPs' gate, up, down,
and the Gated DeltaNet layers' qkv, z and out (in_proj_qkv, in_proj_z, out_proj); `--adapter` exports them as
a PEFT adapter of the Hub's model, and `import --adapter` reads one.
Qwen3.5-MoE and Qwen3-Next import the same way.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "quickstart.py"))
    c.model.update(head_dim=32, qk_norm=True, attention_gate=True, centred_norms=True, rope_fraction=0.25,
                   layer_types=("linear_attention",) * 3 + ("full_attention",))  # fmt: skip
    c.model.linear.update(key_heads=2, value_heads=4, key_dim=32, value_dim=32, conv_kernel=4)
    c.model.d_ff = 336  # the linear layers and the gate hold more than attention: the quick start's parameter count
    return c
