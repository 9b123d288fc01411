"""llm_1b: a 1.11B-parameter LLaMA-style model for a TPU VM or a GPU host.

    python scripts/train_tokenizer.py --config configs/llm_1b.py   # once
    python scripts/plan.py --config configs/llm_1b.py --simulate_devices 8   # memory, before paying for a pod
    python scripts/plan.py --config configs/llm_1b.py --target v5e-4   # the TPU compiler on a slice (the tpu extra)
    python scripts/train.py --config configs/llm_1b.py

16 layers, d_model 2048, 32 query / 8 key-value heads (GQA), SwiGLU 8192,
32768-token vocabulary (untied), 2048-token sequences, bf16 compute with fp32
parameters and AdamW state, full rematerialisation, FSDP over every device.
A global batch of 256 x 2048 = 0.5M tokens; Chinchilla-optimal is ~22B tokens
(20 per parameter), i.e. ~42k steps. On 8 devices the planner shows ~2.2 GB of
parameters and optimiser state per device. With fewer devices, raise
train.grad_accum_steps to keep the microbatch in memory. Point
--config.data.paths (or a TFDS dataset) at a corpus of your own: the default
standard-library corpus is only a smoke test at this size.
"""

from trainer.config import defaults


def get_config():
    c = defaults()
    c.model.update(
        vocab_size=32768,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        max_seq_len=2048,
        remat="full",
        attention="auto",  # splash on a TPU, cuDNN on a GPU, the xla reference on a CPU
    )
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.data.update(seq_len=2048, tokenizer="sentencepiece", tokenizer_path="tokenizers/python_stdlib_32k.model")
    c.precision.compute_dtype = "bfloat16"
    c.optim.update(lr=3e-4, warmup_steps=2000, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1)
    # 8 microbatches of 32 sequences: 4 per device on 8 devices, ~14 GiB each (scripts/plan.py).
    c.train.update(
        steps=42_000, global_batch_size=256, grad_accum_steps=8, log_every=10, eval_every=1000, eval_batches=8
    )
    c.checkpoint.update({"every_steps": 1000, "keep": 3})
    return c
