"""llm_1b_128k: llm_1b continued at 131072-token sequences, each split over 8 devices (context parallelism).

    python scripts/plan.py --config configs/llm_1b_128k.py --target v5p-32   # the TPU compiler, 16 chips
    python scripts/train.py --config configs/llm_1b_128k.py \\
        --config.checkpoint.init_from=<an llm_1b workdir>/checkpoints/<step>

The model is llm_1b's, its RoPE stretched for 64 times the context it was trained at (Llama 3's
frequency scaling: model.rope_scaling). The mesh splits every sequence over context=8 devices
(ring attention, trainer/model/context.py) and the rest over fsdp. A global batch of 8 sequences
is 1M tokens; 4 microbatches of 2 sequences, one per fsdp group. docs/mesh.md ("Long context") has the
plan at 8k / 32k / 128k and context 1 / 4 / 8.
"""

import os

from trainer.config.forms import from_file


def get_config():
    c = from_file(os.path.join(os.path.dirname(__file__), "llm_1b.py"))
    c.model.update(max_seq_len=131072, context_attention="ring")
    c.model.rope_scaling.update(factor=64.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=2048)
    c.mesh.update(context=8, fsdp=-1)
    c.data.seq_len = 131072
    c.optim.update(lr=3e-5, warmup_steps=100, schedule="cosine", min_lr_ratio=0.1)
    c.train.update(steps=2000, global_batch_size=8, grad_accum_steps=4, eval_every=200, eval_batches=2)
    c.checkpoint.update({"every_steps": 200, "keep": 3})
    return c
